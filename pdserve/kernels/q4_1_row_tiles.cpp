// Activation rows of small decode steps (1-2 rows: kTiledMaxRows in fused_layer.cpp) against Q4_1
// weights rearranged at load into tiles of 16 output rows, so that each int32 lane of a 512-bit
// vector is one output row.
// Invariant: each activation row's outputs are bit for bit those of the blocks' one-row kernel
// (quantized_matmul.cpp, q4_1_integer_dot) on that row alone: the same 22-bit activation integers
// (integer_row), the same exact integer sums, and the same float operations on them in the same
// order, only 16 output rows at a time; so also the same whatever the other rows are.
//
// Why: the blocks' kernel takes a row's 32 codes with 16-bit multiply-adds and sums its lanes at
// the end, ~0.47 instructions a weight; it bounds a b=1 step on a CPU whose caches hold the
// model. Here one vpdpbusd multiplies four codes of each of 16 rows by four activation digits
// broadcast from memory (~0.13 instructions a weight), with no horizontal sums. Each further
// activation row costs as much again (the tile comes from cache), while the float row tiles
// unpack a block once for up to 16 rows: against their 512-bit form these are 1.08x at one row,
// 1.01-1.05x at 2, 0.85x at 3, 0.75x at 4 (30 layers' products cycled, two threads, Xeon VM).
//
// The one-row kernel reads two blocks A, B (a pair, 64 weights) a step; its int32 lane j (0..7)
// holds the codes of bytes 4j'..4j'+3 of A (j < 4, j' = j) or B (j' = j - 4), low and high
// nibbles. A tile stores, per pair, exactly those bytes lane-major:
//
//   tile t (rows 16t..16t+15), pair p: 640 bytes
//   +--------------------------------------------------------------------+
//   | quad j = 0: row 0 qs_A[0..3] | row 1 qs_A[0..3] | ... | row 15 ...  |  64 bytes
//   | quad j = 1: qs_A[4..7] of each row                                 |
//   | ... quad 3: qs_A[12..15]; quads 4..7: qs_B[0..3] .. qs_B[12..15]   |  8 x 64 = 512 bytes
//   +--------------------------------------------------------------------+
//   | d_A of rows 0..15 | d_B of rows 0..15 | m_A ... | m_B ...          |  4 x 16 halves = 128 bytes
//   +--------------------------------------------------------------------+
//
// 640 bytes for 16 rows x 64 weights: as many as the blocks (20 bytes a 32). An odd last block
// pairs with itself (its B codes zero, d_B = d_A, m_B = m_A), as in the one-row kernel, whose
// digits and scales for that half are zero.

#include <ATen/ops/zeros.h>

#include "kernels.h"

namespace pdserve::kernels {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ41Bytes = 20;
constexpr int64_t kTileRows = 16;
constexpr int64_t kQuads = 8;
constexpr int64_t kTilePairCodeBytes = kQuads * kTileRows * 4;  // 512
constexpr int64_t kTilePairBytes = kTilePairCodeBytes + 4 * kTileRows * 2;  // 640

void check_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "q4_1_row_tiles: blocks must be uint8 [rows, bytes] on the CPU");
  TORCH_CHECK(blocks.size(1) > 0 && blocks.size(1) % kQ41Bytes == 0, "q4_1_row_tiles: rows are not whole Q4_1 blocks");
  TORCH_CHECK(blocks.size(0) % kTileRows == 0, "q4_1_row_tiles: rows must be a multiple of 16, got ",
              blocks.size(0));
}

}  // namespace

bool q4_1_row_tiles_supported() { return PDSERVE_AVX512_VNNI != 0; }

at::Tensor q4_1_row_tiles(const at::Tensor& blocks) {
  check_blocks(blocks);
  TORCH_CHECK(q4_1_row_tiles_supported(), "q4_1_row_tiles: this CPU has no AVX-512 VNNI");
  const at::Tensor bc = blocks.contiguous();
  const int64_t n = bc.size(0), row_bytes = bc.size(1), block_count = row_bytes / kQ41Bytes;
  const int64_t pairs = (block_count + 1) / 2;
  at::Tensor tiles = at::zeros({n / kTileRows, pairs * kTilePairBytes}, bc.options());
  const uint8_t* src = bc.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, n / kTileRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t p = 0; p < pairs; ++p) {
        uint8_t* out = dst + (t * pairs + p) * kTilePairBytes;
        for (int64_t r = 0; r < kTileRows; ++r) {
          const uint8_t* a = src + (t * kTileRows + r) * row_bytes + 2 * p * kQ41Bytes;
          const bool has_b = 2 * p + 1 < block_count;
          const uint8_t* b = has_b ? a + kQ41Bytes : a;
          for (int64_t j = 0; j < kQuads; ++j) {
            if (j >= 4 && !has_b) continue;  // zero codes: the digits there are zero too
            std::memcpy(out + (j * kTileRows + r) * 4, (j < 4 ? a : b) + 4 + 4 * (j % 4), 4);
          }
          uint8_t* halves = out + kTilePairCodeBytes;
          std::memcpy(halves + (0 * kTileRows + r) * 2, a, 2);  // d_A
          std::memcpy(halves + (1 * kTileRows + r) * 2, b, 2);  // d_B
          std::memcpy(halves + (2 * kTileRows + r) * 2, a + 2, 2);  // m_A
          std::memcpy(halves + (3 * kTileRows + r) * 2, b + 2, 2);  // m_B
        }
      }
    }
  });
  return tiles;
}

#if PDSERVE_AVX512_VNNI
namespace {

inline __m512i broadcast_digits(const int8_t* at) {
  int32_t word;
  std::memcpy(&word, at, sizeof(word));
  return _mm512_set1_epi32(word);
}

// Rows 16t..16t+15 of y = x W.T: lane r of each vector is row r; lane j of the one-row kernel's
// vectors is vector j here (scaled[j], offsets[j]), summed as its horizontal_sum sums its lanes.
__m512 tile_dot(const uint8_t* tile, int64_t pairs, const IntegerRow& row) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 scaled[kQuads], offsets[kQuads];
  for (int j = 0; j < kQuads; ++j) scaled[j] = offsets[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* at = tile + p * kTilePairBytes;
    for (int64_t line = 0; line < kTilePairBytes; line += 64) prefetch_weights_ahead(at + line);
    const __m256i* halves = reinterpret_cast<const __m256i*>(at + kTilePairCodeBytes);
    const __m512 d[2] = {_mm512_cvtph_ps(_mm256_loadu_si256(halves)), _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1))};
    const __m512 m[2] = {_mm512_cvtph_ps(_mm256_loadu_si256(halves + 2)),
                         _mm512_cvtph_ps(_mm256_loadu_si256(halves + 3))};
    const int8_t* digits = row.digits.data() + p * kPairDigitBytes;
    const float* scales = row.scales.data() + p * 16;
    for (int j = 0; j < kQuads; ++j) {
      const __m512i codes = _mm512_loadu_si512(at + j * 64);
      const __m512i low = _mm512_and_si512(codes, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
      // 2^14 sum(codes t2) + 2^7 sum(codes t1) + sum(codes t0), Horner's way: exact in int32.
      __m512i sums = _mm512_setzero_si512();
      for (int digit = 0; digit < 3; ++digit) {
        if (digit > 0) sums = _mm512_slli_epi32(sums, 7);
        sums = _mm512_dpbusd_epi32(sums, low, broadcast_digits(digits + 64 * digit + 4 * j));
        sums = _mm512_dpbusd_epi32(sums, high, broadcast_digits(digits + 64 * digit + 32 + 4 * j));
      }
      scaled[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scales[j])), d[j / 4],
                                  scaled[j]);
      offsets[j] = _mm512_fmadd_ps(m[j / 4], _mm512_set1_ps(scales[8 + j]), offsets[j]);
    }
  }
  __m512 lanes[kQuads];
  for (int j = 0; j < kQuads; ++j) lanes[j] = _mm512_add_ps(scaled[j], offsets[j]);
  // horizontal_sum's tree: (j + j+4), then (0 + 2) and (1 + 3), then those two.
  for (int j = 0; j < 4; ++j) lanes[j] = _mm512_add_ps(lanes[j], lanes[j + 4]);
  return _mm512_add_ps(_mm512_add_ps(lanes[0], lanes[2]), _mm512_add_ps(lanes[1], lanes[3]));
}

}  // namespace
#endif

at::Tensor q4_1_tiled_linear(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "q4_1_tiled_linear: x must be float32 rows [rows, k] on the CPU");
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == at::kByte && tiles.dim() == 2,
              "q4_1_tiled_linear: tiles must be uint8 [n / 16, bytes] (q4_1_row_tiles)");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % kGroup == 0, "q4_1_tiled_linear: in_features must be a positive multiple of 32");
  const int64_t pairs = (k / kGroup + 1) / 2;
  TORCH_CHECK(tiles.size(1) == pairs * kTilePairBytes, "q4_1_tiled_linear: tiles do not match in_features");
  TORCH_CHECK(q4_1_row_tiles_supported(), "q4_1_tiled_linear: this CPU has no AVX-512 VNNI");
  const int64_t n = tiles.size(0) * kTileRows;
  at::Tensor out = at::empty({rows, n}, x.options());
#if PDSERVE_AVX512_VNNI
  if (rows == 0 || n == 0) return out;
  const at::Tensor xc = x.contiguous(), tc = tiles.contiguous();
  std::vector<IntegerRow> rounded(static_cast<size_t>(rows));
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rounded[r] = integer_row(xc.data_ptr<float>() + r * k, k);
  });
  const uint8_t* w = tc.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t tile_bytes = tc.size(1);
  // Each tile is read from memory once and from cache by every further row: a row's arithmetic
  // is the same whatever the row count, so its outputs are too.
  at::parallel_for(0, tc.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        _mm512_storeu_ps(y + r * n + t * kTileRows, tile_dot(w + t * tile_bytes, pairs, rounded[r]));
      }
    }
  });
#endif
  return out;
}

}  // namespace pdserve::kernels
