// The kernels' entry points, declared once for the file that defines each and the files that
// call or register it. Invariant: with fused_layer.h, these are the only names shared across
// the sources; every other helper stays in its file's anonymous namespace (or inline in a header).

#pragma once

#include "common.h"

namespace pdserve::kernels {

// ---- quantized_matmul.cpp ------------------------------------------------------------------

// Q4_1 (block_bytes 20) or Q8_0 (34) blocks [rows, bytes] as float32 weights [rows, in_features].
at::Tensor dequantize_blocks(const at::Tensor& blocks, int64_t block_bytes);
// y = x @ W.T for float32 activations x [rows, in_features] and W as Q4_1 / Q8_0 blocks.
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks);
// The same with batches on the integer lanes at `batch_digits` (q4_1_lanes.cpp; q4_1_linear: the
// one-row kernel's 3, so that a row's tokens do not depend on its batch).
constexpr int64_t kOneRowDigits = 3;
at::Tensor q4_1_batch_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t batch_digits);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks);
// y = x @ W.T for float32 x [rows, k] and W [n, k]; one row has its own kernel, more go to BLAS.
at::Tensor f32_row_linear(const at::Tensor& x, const at::Tensor& weight);

// The Q4_1 product with its path chosen (a test's and a benchmark's handle): lanes 0 runs the
// float row tiles (any row count), 8 or 16 the integer lanes below with `digits`.
at::Tensor q4_1_linear_with(const at::Tensor& x, const at::Tensor& blocks, int64_t lanes, int64_t digits);

#if PDSERVE_AVX2
// One activation row rounded for the one-row Q4_1 products (quantized_matmul.cpp: 22-bit integers
// per block of 32 in three 7-bit digits, the layout drawn there), which q4_1_row_tiles.cpp reads too.
constexpr int64_t kPairDigitBytes = 192;
struct IntegerRow {
  std::vector<int8_t> digits;  // [pairs, 192]
  std::vector<float> scales;  // [pairs, 16]
  int64_t blocks = 0, pairs = 0;
};
IntegerRow integer_row(const float* x, int64_t k);
#endif

// ---- q4_1_row_tiles.cpp ----------------------------------------------------------------------

// Whether this CPU's build has the tiled kernel (AVX-512 VNNI); without it
// q4_1_row_tiles refuses and callers keep the blocks' own kernels.
bool q4_1_row_tiles_supported();
// Q4_1 blocks [n, k / 32 * 20] (n a multiple of 16) rearranged for one-row products: [n / 16, ...].
at::Tensor q4_1_row_tiles(const at::Tensor& blocks);
// y = x @ W.T for rows x [rows, k] and W given as q4_1_row_tiles(W): each row bit for bit
// q4_1_linear's on that row alone.
at::Tensor q4_1_tiled_linear(const at::Tensor& x, const at::Tensor& tiles);

// ---- q4_1_lanes.cpp (compiled with AVX2) -----------------------------------------------------

// y = x @ W.T for float32 rows x [rows, k] and Q4_1 blocks W, the rows across `lanes` vector lanes
// (16: AVX-512 VNNI, 8: AVX2, which q4_1_linear leaves unused: slower than the float tiles), each block of 32 activations rounded to `digits` 7-bit digits
// (3: the one-row kernel's 22-bit integers, 2: 15 bits, 1: 8 bits as llama.cpp's q8 rows).
at::Tensor q4_1_lanes_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t lanes, int64_t digits);
// The lane counts compiled for this CPU, widest first; and the fewest rows q4_1_linear gives them
// at `digits` (fewer run the float row tiles).
std::vector<int64_t> q4_1_lane_widths();
int64_t q4_1_lanes_min_rows(int64_t digits);

// ---- decode_attention.cpp ------------------------------------------------------------------

// A paged K or V cache [blocks, block_size, kv_heads, head_dim], head_dim contiguous; strides in
// elements of `dtype` (float32, bfloat16 or float16: kv_elements.h).
struct PagedCache {
  const void* data;
  at::ScalarType dtype;
  int64_t block_stride, token_stride, head_stride;
  int64_t block_size, num_blocks;

  template <typename T>
  T* elements() const { return static_cast<T*>(const_cast<void*>(data)); }
};

inline PagedCache paged_cache(const at::Tensor& cache) {
  const at::ScalarType dtype = cache.scalar_type();
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "paged_decode_attention: caches must be float32, bfloat16 or float16 [blocks, block_size, kv_heads, "
              "head_dim], head_dim contiguous");
  return PagedCache{cache.data_ptr(), dtype, cache.stride(0), cache.stride(1), cache.stride(2), cache.size(1),
                    cache.size(0)};
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& key_start,
                                  const at::Tensor& key_end, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, double scale,
                                  const std::optional<at::Tensor>& sinks);

// ---- greedy.cpp ----------------------------------------------------------------------------

// Each row's greedy token id as float64 [rows, 1], or -1 for a row with a NaN or an infinity.
at::Tensor greedy_tokens(const at::Tensor& logits);

// ---- fused_layer.cpp -----------------------------------------------------------------------

// y = x @ W.T (+ bias) for float32 x and W as float32 [out, in] (format 0) or Q4_1 / Q8_0 blocks (1, 2);
// batch_digits: q4_1_batch_linear's; row_tiles: W's q4_1_row_tiles, which steps of up to 2 rows use.
at::Tensor weight_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                         const std::optional<at::Tensor>& bias, int64_t batch_digits = kOneRowDigits,
                         const at::Tensor* row_tiles = nullptr);

// (fused_layer.cpp's llama_decode_layer and LlamaDecoderStack: fused_layer.h.)

}  // namespace pdserve::kernels
