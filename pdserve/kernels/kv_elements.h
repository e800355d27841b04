// The element types a paged KV pool may hold (float32, bfloat16, float16) and how the kernels
// read and write them: one template per loop, instantiated for each type by `with_kv_element`.
// Invariant: a 16-bit element is widened to float32 exactly (both types embed in float32) and
// every sum over them is float32; a store rounds to nearest even, as torch's `.to()` does.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "common.h"

namespace pdserve::kernels {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

#if PDSERVE_AVX2
// Eight consecutive elements widened to float32 in registers: bfloat16 is float32's upper half
// (a shift), float16 converts with F16C (both in AVX2 and AVX-512 machines).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// n float32 values stored as T (one token's head: a decode step stores one per row and layer).
template <typename T>
inline void store_elements(T* out, const float* in, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, in, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = T(in[i]);
  }
}

// Calls fn(T{}) with T the C++ type of a pool of `dtype`; any other dtype is refused by name.
template <typename Fn>
decltype(auto) with_kv_element(at::ScalarType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    case at::kHalf: return fn(c10::Half{});
    default: TORCH_CHECK(false, what, ": KV caches must be float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace pdserve::kernels
