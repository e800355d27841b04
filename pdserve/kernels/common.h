// What every kernel source of pdserve's native CPU library shares: the ATen includes, the
// PDSERVE_AVX2 switch and the small vector helpers that hot loops in several files call.
// Invariant: the helpers here are `inline` so each stays inlined in the loops that call it.
//
// The sources (compiled into one library by pdserve/kernels/native.py):
//   quantized_matmul.cpp  linear layers over Q4_1/Q8_0 blocks, and float32 one-row products
//   q4_1_lanes.cpp        Q4_1 products for a batch of rows across vector lanes, in integers
//   q4_1_row_tiles.cpp    one-row Q4_1 products over weights rearranged in tiles of 16 output rows
//   decode_attention.cpp  decode attention that reads K/V straight from the paged pool
//   greedy.cpp            the greedy choice of each row's token
//   fused_layer.cpp       one Llama-family decoder layer per call, and the stack of them
//   moe_experts.cpp       a mixture-of-experts MLP per call: routing, grouping, every active expert
//   registration.cpp      the pdserve_cpu op library: schemas and CPU implementations
// kernels.h, moe_experts.h and fused_layer.h declare what one of them calls or registers from another;
// expert_rows.h holds how moe_experts.cpp reads float32, bfloat16 and MXFP4 weight rows;
// kv_elements.h holds the KV pool's element types (float32, bfloat16, float16) and their loads.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#else
#define PDSERVE_AVX2 0
#endif

// AVX-512 with VNNI (vpdpbusd): q4_1_lanes.cpp's 16-lane products; otherwise its 8-lane AVX2 ones.
#if PDSERVE_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PDSERVE_AVX512_VNNI 1
#else
#define PDSERVE_AVX512_VNNI 0
#endif

// AVX-512F: moe_experts.cpp decodes 16 MXFP4 weights a vector (a 16-entry table lookup).
#if PDSERVE_AVX2 && defined(__AVX512F__)
#define PDSERVE_AVX512F 1
#else
#define PDSERVE_AVX512F 0
#endif

namespace pdserve::kernels {

#if PDSERVE_AVX2
// Loops that stream weights from memory (one-row and batched products, the LM head) ask for the
// bytes this far ahead of the block they multiply. The hardware prefetcher alone left a one-row
// Q4_1 product at 3.4 GB/s from memory on one thread where a plain read streams 13-14 GB/s
// (Xeon with AMX, 2-core VM, 2026-11-28; 100 gate|up matrices cycled); 4 KiB ahead: 7.8 GB/s (2 KiB
// 7.5, 1 KiB 6.9, 512 B 6.1), and a b=1 decode step 2.49x faster (`python -m bench.kernels decode-ab
// --baseline cc9760d --threads 2 --clock wall`: 15.7 -> 6.3 ms). Past the end of a buffer a
// prefetch is dropped, never faults.
constexpr int64_t kWeightPrefetchBytes = 4096;

inline void prefetch_weights_ahead(const void* at) {
  _mm_prefetch(static_cast<const char*>(at) + kWeightPrefetchBytes, _MM_HINT_T0);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x, 8 at a time: e^x = 2^n e^r with |r| <= ln(2)/2 and a degree-6 polynomial for e^r, within
// 2 ulp of std::exp. x is clamped to [-87, 88] (e^x stays a normal float: ~1e-38 below, not 0;
// ~1.7e38 above, not inf), and a NaN stays NaN so that a broken row shows in its logits.
inline __m256 exp8(__m256 x) {
  // min/max return their second operand when either is NaN: the operand order keeps NaN.
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}
#endif

}  // namespace pdserve::kernels
