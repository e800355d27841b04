// Native CPU kernels of pdserve: linear layers over GGUF-style quantized blocks, and decode
// attention that reads K/V straight from the paged pool.
//
// Invariants: weights are multiplied in the block format they are stored in (each block is
// expanded to floats in registers, never to a float copy in memory), in float32 like the
// dequantized model they stand for; decode attention reads only the keys [key_start, key_end) of
// each row (plus its own new key when given) from the pages its block table names, and allocates
// nothing that grows with the context.
//
// Block formats (32 weights per block along the input dimension; d and m are IEEE half floats):
//
//   Q4_1  20 bytes  | d | m | qs[16] |   w[j] = d * (qs[j] & 15) + m,  w[j+16] = d * (qs[j] >> 4) + m
//   Q8_0  34 bytes  | d | qs[32]     |   w[j] = d * qs[j]            (qs signed)
//
// Activations are float32, except that one row against Q4_1 blocks (the batch-1 decode step) is
// rounded to 22-bit integers per block of 32, as fine as float32's own rounding, and multiplied
// in bytes (see `integer_row`). 8-bit activations, as llama.cpp uses, cost the embedded model
// 3.7% of its top-1 agreement with its dequantized self (bench/activation_rounding.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#else
#define PDSERVE_AVX2 0
#endif

namespace pdserve {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ41Bytes = 20;
constexpr int64_t kQ80Bytes = 34;
constexpr int64_t kRowTile = 8;  // activation rows that share one unpacked weight block
// Past this many rows (prefill) a float matmul over the dequantized weight beats the block
// kernels: BLAS reuses each weight from cache across rows far better than a row tile can.
constexpr int64_t kKernelMaxRows = 32;

float half_to_float(uint16_t h) {
#if PDSERVE_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exponent = 127 - 15 + 1;
      while (!(mantissa & 0x400u)) {
        mantissa <<= 1;
        exponent--;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

uint16_t read_u16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// ---- dequantization (prefill-sized batches run as float matmuls over dequantized weights) ---

void dequantize_row(const uint8_t* row, int64_t k, int64_t block_bytes, float* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* block = row + g * block_bytes;
    const float d = half_to_float(read_u16(block));
    float* w = out + g * kGroup;
    if (block_bytes == kQ41Bytes) {
      const float m = half_to_float(read_u16(block + 2));
      for (int64_t j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(block[4 + j] & 15) + m;
        w[j + 16] = d * static_cast<float>(block[4 + j] >> 4) + m;
      }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
      for (int64_t j = 0; j < kGroup; ++j) w[j] = d * static_cast<float>(q[j]);
    }
  }
}

at::Tensor dequantize_blocks(const at::Tensor& blocks, int64_t block_bytes) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "dequantize_blocks: blocks must be uint8 [rows, bytes] on the CPU");
  TORCH_CHECK(block_bytes == kQ41Bytes || block_bytes == kQ80Bytes, "dequantize_blocks: unknown block size");
  TORCH_CHECK(blocks.size(1) % block_bytes == 0, "dequantize_blocks: row bytes are not whole blocks");
  const at::Tensor bc = blocks.contiguous();
  const int64_t rows = bc.size(0), row_bytes = bc.size(1), k = row_bytes / block_bytes * kGroup;
  at::Tensor out = at::empty({rows, k}, bc.options().dtype(at::kFloat));
  const uint8_t* src = bc.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequantize_row(src + r * row_bytes, k, block_bytes, dst + r * k);
  });
  return out;
}

// ---- block-quantized linear layers ---------------------------------------------------------

#if PDSERVE_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of one block as four vectors of 8 floats, in order.
struct BlockWeights {
  __m256 w[4];
};

inline __m256 bytes_to_floats_s8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// A Q4_1 block unpacked without byte shuffles: each 4-byte word of qs is broadcast and shifted
// per lane, so its weights come out in "lane order" (for word p: weights 4p..4p+3, then
// 4p+16..4p+19), and the activations are permuted to match once per call (`to_lane_order`).
inline BlockWeights load_q4_1_lanes(const uint8_t* block) {
  const __m256 d = _mm256_set1_ps(half_to_float(read_u16(block)));
  const __m256 m = _mm256_set1_ps(half_to_float(read_u16(block + 2)));
  const __m256i shifts = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
  const __m256i mask = _mm256_set1_epi32(0x0f);
  BlockWeights out;
  for (int part = 0; part < 4; ++part) {
    int32_t word;
    std::memcpy(&word, block + 4 + 4 * part, sizeof(word));
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
    out.w[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibbles), d, m);
  }
  return out;
}

inline BlockWeights load_q8_0(const uint8_t* block) {
  const __m256 d = _mm256_set1_ps(half_to_float(read_u16(block)));
  BlockWeights out;
  for (int part = 0; part < 4; ++part) {  // 8-byte loads widen in one step: no byte shifts
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * part));
    out.w[part] = _mm256_mul_ps(bytes_to_floats_s8(bytes), d);
  }
  return out;
}

// Independent FMA chains per row: enough in flight to cover the FMA latency (4 cycles, two
// units) whatever the tile height, without running out of the 16 vector registers.
constexpr int accumulators_per_row(int rows) { return rows == 1 ? 4 : (rows <= 3 ? 2 : 1); }

// out[r * out_stride] = dot(x row r, weight row) for r < kRows: each block is dequantized into
// registers once and multiplied with every row of the tile.
template <int kRows, BlockWeights (*kLoad)(const uint8_t*)>
void row_tile(const uint8_t* w, int64_t block_bytes, const float* x, int64_t k, float* out, int64_t out_stride) {
  constexpr int kAccs = accumulators_per_row(kRows);
  __m256 acc[kRows][kAccs];
  for (int r = 0; r < kRows; ++r) {
    for (int a = 0; a < kAccs; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const BlockWeights b = kLoad(w + g * block_bytes);
    for (int r = 0; r < kRows; ++r) {
      const float* xs = x + r * k + g * kGroup;
      for (int part = 0; part < 4; ++part) {
        acc[r][part % kAccs] = _mm256_fmadd_ps(b.w[part], _mm256_loadu_ps(xs + 8 * part), acc[r][part % kAccs]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m256 total = acc[r][0];
    for (int a = 1; a < kAccs; ++a) total = _mm256_add_ps(total, acc[r][a]);
    out[r * out_stride] = horizontal_sum(total);
  }
}
#endif

// Portable tile: dequantize the weight row once, then plain dot products.
template <int kRows>
void row_tile_portable(const uint8_t* w, int64_t block_bytes, const float* x, int64_t k, float* out,
                       int64_t out_stride) {
  std::vector<float> weights(k);
  dequantize_row(w, k, block_bytes, weights.data());
  for (int r = 0; r < kRows; ++r) {
    float total = 0.f;
    for (int64_t i = 0; i < k; ++i) total += weights[i] * x[r * k + i];
    out[r * out_stride] = total;
  }
}

using RowTileKernel = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*, int64_t);

struct RowTileKernels {
  RowTileKernel by_rows[kRowTile];  // [r - 1]: the kernel for r activation rows
};

template <int kBlockBytes>
RowTileKernels row_tile_kernels() {
#if PDSERVE_AVX2
  constexpr auto load = kBlockBytes == kQ41Bytes ? load_q4_1_lanes : load_q8_0;
  return RowTileKernels{{row_tile<1, load>, row_tile<2, load>, row_tile<3, load>, row_tile<4, load>,
                         row_tile<5, load>, row_tile<6, load>, row_tile<7, load>, row_tile<8, load>}};
#else
  return RowTileKernels{{row_tile_portable<1>, row_tile_portable<2>, row_tile_portable<3>, row_tile_portable<4>,
                         row_tile_portable<5>, row_tile_portable<6>, row_tile_portable<7>, row_tile_portable<8>}};
#endif
}

#if PDSERVE_AVX2
// ---- one activation row against Q4_1 blocks, in integers ------------------------------------
//
// The row is cut into blocks of 32 like the weights; block g gets a scale s = max|x| / (2^21 - 1)
// and 22-bit integers q = round(x / s), written in three 7-bit digits q = 2^14 t2 + 2^7 t1 + t0
// (t2 in [-128, 127] carries the sign, t1 and t0 in [0, 127]), so that
//
//   dot(w, x) over block g = d s (2^14 sum(qs t2) + 2^7 sum(qs t1) + sum(qs t0)) + m sum(x)
//
// where the three integer sums are byte multiply-adds (vpmaddubsw: the 4-bit codes are its
// unsigned operand) and sum(x) is taken in float. Error: |s q - x| <= s / 2, 2.4e-7 of the
// block's largest activation: float32's own rounding, so that a one-row step and a batched one
// (float tiles) pick the same greedy tokens. (Two digits, 15 bits, were 5% faster but 3e-5
// coarse, enough to flip near-tied tokens between batch sizes.) A NaN or infinity in x stays
// one in every output (via sum(x)).
//
// Two blocks A, B are read as one vector, their nibbles in two 16-byte halves; the row's digits
// are laid out per pair to match:
//
//   pair p (192 bytes of digits, then 16 floats):
//   +-------------+-------------+-------------+-------------+-------------+-------------+
//   | t2 A0..15   | t2 A16..31  | t1 A0..15   | t1 A16..31  | t0 A0..15   | t0 A16..31  |
//   |    B0..15   |    B16..31  |    B0..15   |    B16..31  |    B0..15   |    B16..31  |
//   +-------------+-------------+-------------+-------------+-------------+-------------+
//   (each 32 bytes: A's 16 digits, then B's 16)
//   +----------------+------------------------+
//   | s_A x4, s_B x4 | sum_A/4 x4, sum_B/4 x4 |   (a lane per partial sum of 8 weights' pairs)
//   +----------------+------------------------+
//
// An odd last block pairs with itself, its B half's digits, scales and sums zero.

constexpr float kRowIntMax = 2097151.f;  // 2^21 - 1
constexpr int64_t kPairDigitBytes = 192;

struct IntegerRow {
  std::vector<int8_t> digits;  // [pairs, 192]
  std::vector<float> scales;  // [pairs, 16]
  int64_t blocks = 0, pairs = 0;
};

IntegerRow integer_row(const float* x, int64_t k) {
  IntegerRow row;
  row.blocks = k / kGroup;
  row.pairs = (row.blocks + 1) / 2;
  row.digits.assign(row.pairs * kPairDigitBytes, 0);
  row.scales.assign(row.pairs * 16, 0.f);
  for (int64_t g = 0; g < row.blocks; ++g) {
    const float* xs = x + g * kGroup;
    float largest = 0.f, total = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) {
      largest = std::max(largest, std::fabs(xs[j]));
      total += xs[j];
    }
    const float inverse = largest > 0.f ? kRowIntMax / largest : 0.f;
    const int64_t pair = g / 2, half = g % 2;
    int8_t* digits = row.digits.data() + pair * kPairDigitBytes;
    for (int64_t j = 0; j < kGroup; ++j) {
      const float scaled = std::min(kRowIntMax, std::max(-kRowIntMax, xs[j] * inverse));
      const int32_t q = std::isfinite(scaled) ? static_cast<int32_t>(std::nearbyint(scaled)) : 0;
      const int64_t at = (j / 16) * 32 + half * 16 + j % 16;
      digits[at] = static_cast<int8_t>(q >> 14);  // arithmetic shift: floor(q / 2^14)
      digits[64 + at] = static_cast<int8_t>((q >> 7) & 127);
      digits[128 + at] = static_cast<int8_t>(q & 127);
    }
    float* scales = row.scales.data() + pair * 16 + half * 4;
    for (int lane = 0; lane < 4; ++lane) {
      scales[lane] = largest / kRowIntMax;
      scales[8 + lane] = total / 4;
    }
  }
  return row;
}

float q4_1_integer_dot(const uint8_t* w, const IntegerRow& row) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i by_2_14 = _mm256_set1_epi16(1 << 14), by_2_7 = _mm256_set1_epi16(1 << 7), by_1 = _mm256_set1_epi16(1);
  __m256 scaled = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
  for (int64_t p = 0; p < row.pairs; ++p) {
    const uint8_t* a = w + 2 * p * kQ41Bytes;
    const uint8_t* b = 2 * p + 1 < row.blocks ? a + kQ41Bytes : a;
    const __m256i packed = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 4))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)), 1);
    const __m256i low = _mm256_and_si256(packed, nibble);  // codes 0..15 of A, then of B
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);  // codes 16..31
    const __m256i* digits = reinterpret_cast<const __m256i*>(row.digits.data() + p * kPairDigitBytes);
    __m256i by_digit[3];  // pair sums of codes x digit, each at most 2 * 2 * 15 * 128: no int16 overflow
    for (int d = 0; d < 3; ++d) {
      by_digit[d] = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256(digits + 2 * d)),
                                     _mm256_maddubs_epi16(high, _mm256_loadu_si256(digits + 2 * d + 1)));
    }
    const __m256i sums = _mm256_add_epi32(
        _mm256_add_epi32(_mm256_madd_epi16(by_digit[0], by_2_14), _mm256_madd_epi16(by_digit[1], by_2_7)),
        _mm256_madd_epi16(by_digit[2], by_1));
    int32_t dm_a, dm_b;  // each block's (d, m) halves
    std::memcpy(&dm_a, a, sizeof(dm_a));
    std::memcpy(&dm_b, b, sizeof(dm_b));
    const __m256 dm = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_set1_epi32(dm_a), _mm_set1_epi32(dm_b)));
    const float* scales = row.scales.data() + p * 16;
    scaled = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(scales)),
                             _mm256_moveldup_ps(dm), scaled);
    offsets = _mm256_fmadd_ps(_mm256_movehdup_ps(dm), _mm256_loadu_ps(scales + 8), offsets);
  }
  return horizontal_sum(_mm256_add_ps(scaled, offsets));
}

// y = x @ W.T for one row x [1, k] and Q4_1 blocks W [n, k / 32 * 20], the weight rows split
// among threads.
at::Tensor q4_1_integer_row_linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  const IntegerRow row = integer_row(x.data_ptr<float>(), k);
  at::Tensor out = at::empty({1, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) y[col] = q4_1_integer_dot(w + col * row_bytes, row);
  });
  return out;
}
#endif

// Activations [rows, k] in the order `load_q4_1_lanes` yields each block's weights.
at::Tensor to_lane_order(const at::Tensor& x) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t total_blocks = x.numel() / kGroup;
  for (int64_t g = 0; g < total_blocks; ++g) {
    const float* in = src + g * kGroup;
    float* o = dst + g * kGroup;
    for (int part = 0; part < 4; ++part) {
      std::memcpy(o + 8 * part, in + 4 * part, 4 * sizeof(float));
      std::memcpy(o + 8 * part + 4, in + 16 + 4 * part, 4 * sizeof(float));
    }
  }
  return out;
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t block_bytes,
                        const RowTileKernels& kernels, const char* name, bool lane_order = false) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": activations must be float32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, name, ": blocks must be uint8 [out, bytes]");
  TORCH_CHECK(x.dim() == 2, name, ": activations must be [rows, in_features]");
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % kGroup == 0, name, ": in_features must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) == k / kGroup * block_bytes, name, ": blocks do not match in_features");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = blocks.contiguous();
  if (rows > kKernelMaxRows) return at::mm(xc, dequantize_blocks(wc, block_bytes).t());
#if PDSERVE_AVX2
  if (rows == 1 && block_bytes == kQ41Bytes && n > 0) return q4_1_integer_row_linear(xc, wc);
#endif
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const at::Tensor xl = lane_order ? to_lane_order(xc) : xc;
  const float* xs = xl.data_ptr<float>();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t row_bytes = wc.size(1);
  // Split the weight rows among threads: each thread streams its own slice of the weights once
  // per tile of activation rows; a slice of 64 weight rows stays in L2 across those tiles.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t col0 = begin; col0 < end; col0 += 64) {
      const int64_t col_end = std::min(end, col0 + 64);
      for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
        const RowTileKernel kernel = kernels.by_rows[std::min(kRowTile, rows - row0) - 1];
        for (int64_t col = col0; col < col_end; ++col) {
          kernel(w + col * row_bytes, block_bytes, xs + row0 * k, k, y + row0 * n + col, n);
        }
      }
    }
  });
  return out;
}

// ---- float32 weights, one activation row ------------------------------------------------------
//
// y = x @ W.T for x [1, k] and W [n, k]: one dot product per weight row, the rows split among
// threads. BLAS's single-row product kept to one core here (a third of the read bandwidth).

float dot_long(const float* a, const float* b, int64_t n) {
#if PDSERVE_AVX2
  if (n % 32 == 0) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < n; i += 32) {
      for (int part = 0; part < 4; ++part) {
        acc[part] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * part), _mm256_loadu_ps(b + i + 8 * part), acc[part]);
      }
    }
    return horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
#endif
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

at::Tensor f32_row_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "f32_row_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "f32_row_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "f32_row_linear: x [rows, k] and weight [n, k]");
  if (x.size(0) != 1) return at::mm(x, weight.t());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t k = wc.size(1), n = wc.size(0);
  at::Tensor out = at::empty({1, n}, x.options());
  const float* xs = xc.data_ptr<float>();
  const float* w = wc.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) y[col] = dot_long(w + col * k, xs, k);
  });
  return out;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks) {
  static const RowTileKernels kernels = row_tile_kernels<kQ41Bytes>();
  return block_linear(x, blocks, kQ41Bytes, kernels, "q4_1_linear", PDSERVE_AVX2 != 0);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks) {
  static const RowTileKernels kernels = row_tile_kernels<kQ80Bytes>();
  return block_linear(x, blocks, kQ80Bytes, kernels, "q8_0_linear");
}

// ---- paged decode attention -----------------------------------------------------------------
//
// One query row attends to its keys in tiles of kKeyTile: the tile's scores for every query head
// of a KV head, their exponentials (an online softmax across tiles), then the tile's values
// weighted into per-head accumulators. A long context is split into key ranges that threads
// attend to independently; the partial softmax states of one (row, KV head) are merged at the end.

constexpr int64_t kKeyTile = 64;  // keys scored at once; bounds the per-task scratch
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kKeysPerSplit = 64;  // the shortest key range a thread is given on its own
// Multiply-adds below which one thread attends (~60 keys of a 9-head layer of 64): a parallel
// region costs a few microseconds, and above this two threads read the pages faster than one
// (bench/decode_attention.py, 264 keys: 45 -> 33 us a call; 400 keys: 84 -> 47 us).
constexpr int64_t kParallelAttentionWork = 1 << 16;

inline float dot(const float* a, const float* b, int64_t n) {
#if PDSERVE_AVX2
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return horizontal_sum(acc);
  }
#endif
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

#if PDSERVE_AVX2
// The eight horizontal sums of a[0..7], in order, as one vector.
inline __m256 horizontal_sums8(const __m256 (&a)[8]) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
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

struct PagedCache {
  const float* data;
  int64_t block_stride, token_stride, head_stride;
  int64_t block_size, num_blocks;
};

PagedCache paged_cache(const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kFloat && cache.stride(3) == 1,
              "paged_decode_attention: caches must be float32 [blocks, block_size, kv_heads, head_dim], head_dim contiguous");
  return PagedCache{cache.data_ptr<float>(), cache.stride(0), cache.stride(1), cache.stride(2), cache.size(1),
                    cache.size(0)};
}

// Where the token rows (every KV head) of keys (or values) [begin, begin + count) lie.
void token_rows(const PagedCache& cache, const int32_t* table, int64_t begin, int64_t count, const float** out) {
  int64_t block_index = begin / cache.block_size, offset = begin % cache.block_size;
  const float* page = nullptr;
  for (int64_t t = 0; t < count; ++t) {
    if (t == 0 || offset == 0) {
      const int64_t block = table[block_index];
      TORCH_CHECK(block >= 0 && block < cache.num_blocks, "paged_decode_attention: block id ", block, " out of range");
      page = cache.data + block * cache.block_stride;
    }
    out[t] = page + offset * cache.token_stride;
    if (++offset == cache.block_size) {
      offset = 0;
      ++block_index;
    }
  }
}

// Online softmax state of `group` query heads sharing one KV head, over the keys seen so far:
// acc[g] = sum_t e^(s[g][t] - max[g]) v_t and sum[g] = sum_t e^(s[g][t] - max[g]).
struct SoftmaxState {
  int64_t group = 0, head_dim = 0;
  float max[kMaxGroup];
  float sum[kMaxGroup];
  float* acc = nullptr;  // [group, head_dim], owned by the caller

  void reset(int64_t group_, int64_t head_dim_, float* acc_) {
    group = group_, head_dim = head_dim_, acc = acc_;
    for (int64_t g = 0; g < group; ++g) {
      max[g] = -std::numeric_limits<float>::infinity();
      sum[g] = 0.f;
    }
    std::fill(acc, acc + group * head_dim, 0.f);
  }

  // scores[g][t] = scale * q[g] . (keys[t] + at)
  void score(const float* q, const float* const* keys, int64_t at, int64_t count, float scale,
             float (*scores)[kKeyTile]) const {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      int64_t t = 0;
#if PDSERVE_AVX2
      if (head_dim % 8 == 0) {  // eight keys at a time: eight independent FMA chains
        for (; t + 8 <= count; t += 8) {
          __m256 partial[8];
          for (int j = 0; j < 8; ++j) partial[j] = _mm256_setzero_ps();
          for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + i);
            for (int j = 0; j < 8; ++j) partial[j] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[t + j] + at + i), qv, partial[j]);
          }
          _mm256_storeu_ps(scores[g] + t, _mm256_mul_ps(horizontal_sums8(partial), _mm256_set1_ps(scale)));
        }
      }
#endif
      for (; t < count; ++t) scores[g][t] = dot(qg, keys[t] + at, head_dim) * scale;
    }
  }

  // Turns scores into weights e^(s - max) and rescales what came before to the new maximum.
  void exponentiate(float (*scores)[kKeyTile], int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      float tile_max = max[g];
      for (int64_t t = 0; t < count; ++t) tile_max = std::max(tile_max, scores[g][t]);
      const float rescale = std::exp(max[g] - tile_max);  // 0 on the first tile (max was -inf)
      float tile_sum = 0.f;
      int64_t t = 0;
#if PDSERVE_AVX2
      const __m256 shift = _mm256_set1_ps(tile_max);
      __m256 sums = _mm256_setzero_ps();
      for (; t + 8 <= count; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores[g] + t), shift));
        _mm256_storeu_ps(scores[g] + t, e);
        sums = _mm256_add_ps(sums, e);
      }
      tile_sum = horizontal_sum(sums);
#endif
      for (; t < count; ++t) {
        scores[g][t] = std::exp(scores[g][t] - tile_max);
        tile_sum += scores[g][t];
      }
      if (rescale != 1.f) {
        for (int64_t i = 0; i < head_dim; ++i) acc[g * head_dim + i] *= rescale;
      }
      sum[g] = sum[g] * rescale + tile_sum;
      max[g] = tile_max;
    }
  }

  // acc[g] += sum_t weights[g][t] * (values[t] + at)
  void accumulate(const float (*weights)[kKeyTile], const float* const* values, int64_t at, int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      float* out = acc + g * head_dim;
      int64_t i = 0;
#if PDSERVE_AVX2
      for (; i + 64 <= head_dim; i += 64) {  // 64 dims at a time: eight independent FMA chains
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(out + i + 8 * j);
        for (int64_t t = 0; t < count; ++t) {
          const __m256 w = _mm256_set1_ps(weights[g][t]);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values[t] + at + i + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + i + 8 * j, a[j]);
      }
#endif
      for (int64_t t = 0; t < count; ++t) {
        for (int64_t d = i; d < head_dim; ++d) out[d] += weights[g][t] * values[t][at + d];
      }
    }
  }

  void add(const float* q, const float* const* keys, const float* const* values, int64_t at, int64_t count,
           float scale) {
    float scores[kMaxGroup][kKeyTile];
    score(q, keys, at, count, scale, scores);
    exponentiate(scores, count);
    accumulate(scores, values, at, count);
  }

  // Folds another state over other keys of the same heads into this one.
  void merge(const SoftmaxState& other) {
    for (int64_t g = 0; g < group; ++g) {
      if (other.max[g] == -std::numeric_limits<float>::infinity()) continue;  // saw no key
      const float top = std::max(max[g], other.max[g]);
      const float mine = std::exp(max[g] - top), theirs = std::exp(other.max[g] - top);
      for (int64_t i = 0; i < head_dim; ++i) {
        acc[g * head_dim + i] = acc[g * head_dim + i] * mine + other.acc[g * head_dim + i] * theirs;
      }
      sum[g] = sum[g] * mine + other.sum[g] * theirs;
      max[g] = top;
    }
  }

  void write(float* out) const {
    for (int64_t g = 0; g < group; ++g) {
      const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
      for (int64_t i = 0; i < head_dim; ++i) out[g * head_dim + i] = acc[g * head_dim + i] * inv;
    }
  }
};

// Folds keys [begin, end) of every KV head of one row (from the pages) into states[h], then the
// row's own new keys when given ([kv_heads, head_dim]). Tile by tile, every head in turn, so that
// each tile's token rows are read from memory once. (Prefetching the next tile in software made
// no measurable difference here.)
void attend_range(SoftmaxState* states, int64_t kv_heads, const float* q, const PagedCache& keys,
                  const PagedCache& values, const int32_t* table, int64_t begin, int64_t end, const float* new_keys,
                  const float* new_values, float scale) {
  const int64_t group = states[0].group, head_dim = states[0].head_dim;
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];
  for (int64_t tile = begin; tile < end; tile += kKeyTile) {
    const int64_t count = std::min(kKeyTile, end - tile);
    token_rows(keys, table, tile, count, key_rows);
    token_rows(values, table, tile, count, value_rows);
    for (int64_t h = 0; h < kv_heads; ++h) {
      states[h].add(q + h * group * head_dim, key_rows, value_rows, h * keys.head_stride, count, scale);
    }
  }
  if (new_keys == nullptr) return;
  for (int64_t h = 0; h < kv_heads; ++h) {
    states[h].add(q + h * group * head_dim, &new_keys, &new_values, h * head_dim, 1, scale);
  }
}

void check_new_kv(const std::optional<at::Tensor>& t, int64_t rows, int64_t kv_heads, int64_t head_dim) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == rows && t->size(1) == kv_heads &&
                  t->size(2) == head_dim,
              "paged_decode_attention: new k/v must be float32 [rows, kv_heads, head_dim]");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& key_start,
                                  const at::Tensor& key_end, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode_attention: q must be float32 [rows, heads, dim]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "paged_decode_attention: int32 block table");
  TORCH_CHECK(key_start.scalar_type() == at::kInt && key_end.scalar_type() == at::kInt, "paged_decode_attention: int32 bounds");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_decode_attention: give both new k and new v, or neither");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(), "paged_decode_attention: cache shape");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "paged_decode_attention: head grouping");
  TORCH_CHECK(block_table.size(0) == rows && key_start.numel() == rows && key_end.numel() == rows,
              "paged_decode_attention: one table row and one key range per query row");
  check_new_kv(k_new, rows, kv_heads, head_dim);
  check_new_kv(v_new, rows, kv_heads, head_dim);
  const PagedCache keys = paged_cache(k_cache), values = paged_cache(v_cache);
  const at::Tensor qc = q.contiguous(), table = block_table.contiguous();
  const at::Tensor starts = key_start.contiguous(), ends = key_end.contiguous();
  const at::Tensor kn = k_new.has_value() ? k_new->contiguous() : at::Tensor();
  const at::Tensor vn = v_new.has_value() ? v_new->contiguous() : at::Tensor();
  const int64_t width = table.size(1), block_size = keys.block_size;
  const int32_t* start_data = starts.data_ptr<int32_t>();
  const int32_t* end_data = ends.data_ptr<int32_t>();
  int64_t work = 0, longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= start_data[r] && start_data[r] <= end_data[r] && end_data[r] <= width * block_size,
                "paged_decode_attention: key range of row ", r, " does not fit its block table");
    TORCH_CHECK(end_data[r] > start_data[r] || kn.defined(), "paged_decode_attention: row ", r, " sees no key");
    work += (end_data[r] - start_data[r] + 1) * heads * head_dim * 2;
    longest = std::max<int64_t>(longest, end_data[r] - start_data[r]);
  }
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const int64_t group = heads / kv_heads;
  const float* q_data = qc.data_ptr<float>();
  const int32_t* table_data = table.data_ptr<int32_t>();
  const float* kn_data = kn.defined() ? kn.data_ptr<float>() : nullptr;
  const float* vn_data = vn.defined() ? vn.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();

  // Tasks are (row, split): split s of a row attends, for every KV head, to the s-th of `splits`
  // equal key ranges (the last split also to the row's new keys). Few rows with long contexts
  // get enough splits to keep every thread busy; a small step runs on the calling thread alone.
  const bool parallel = work >= kParallelAttentionWork && at::get_num_threads() > 1;
  int64_t splits = 1;
  if (parallel && rows < 2 * at::get_num_threads()) {
    const int64_t wanted = (2 * at::get_num_threads() + rows - 1) / rows;
    splits = std::max<int64_t>(1, std::min(wanted, longest / kKeysPerSplit));
  }
  const int64_t num_tasks = rows * splits;
  std::vector<float> scratch(num_tasks * heads * head_dim);
  std::vector<SoftmaxState> states(num_tasks * kv_heads);
  at::parallel_for(0, num_tasks, parallel ? 1 : std::max<int64_t>(num_tasks, 1), [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / splits, s = task % splits;
      const int64_t begin = start_data[r], length = end_data[r] - begin;
      const bool owns_new_keys = kn_data != nullptr && s == splits - 1;
      SoftmaxState* task_states = states.data() + task * kv_heads;
      for (int64_t h = 0; h < kv_heads; ++h) {
        task_states[h].reset(group, head_dim, scratch.data() + (task * kv_heads + h) * group * head_dim);
      }
      attend_range(task_states, kv_heads, q_data + r * heads * head_dim, keys, values, table_data + r * width,
                   begin + length * s / splits, begin + length * (s + 1) / splits,
                   owns_new_keys ? kn_data + r * kv_heads * head_dim : nullptr,
                   owns_new_keys ? vn_data + r * kv_heads * head_dim : nullptr, static_cast<float>(scale));
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    SoftmaxState* row_states = states.data() + r * splits * kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t s = 1; s < splits; ++s) row_states[h].merge(row_states[s * kv_heads + h]);
      row_states[h].write(out_data + (r * heads + h * group) * head_dim);
    }
  }
  return out;
}

// ---- greedy choice ----------------------------------------------------------------------------
//
// Per row of float32 logits [rows, vocab]: the first index of the largest value, as float64 (the
// sampler's packed form: ids are exact in float64), or -1 when the row holds a NaN or an
// infinity, which the sampler fails alone. One pass for the maximum and finiteness, one to find
// where it is: what argmax, isfinite().all() and amax() take six passes and temporaries for.

constexpr double kFailedToken = -1.0;  // pdserve.engine.sampler.FAILED_TOKEN_ID

double greedy_row(const float* x, int64_t vocab) {
  int64_t i = 0;
  float largest = -std::numeric_limits<float>::infinity();
  bool finite = true;
#if PDSERVE_AVX2
  __m256 top = _mm256_set1_ps(largest);
  __m256 broken = _mm256_setzero_ps();  // lanes where some x - x was not 0 (x NaN or infinite)
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    broken = _mm256_or_ps(broken, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  finite = _mm256_movemask_ps(broken) == 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (float lane : lanes) largest = std::max(largest, lane);
#endif
  for (; i < vocab; ++i) {
    finite = finite && std::isfinite(x[i]);
    largest = std::max(largest, x[i]);
  }
  if (!finite || vocab == 0) return kFailedToken;
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] == largest) return static_cast<double>(j);
  }
  return kFailedToken;
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "greedy_tokens: logits must be float32 [rows, vocab] on the CPU");
  const at::Tensor lc = logits.contiguous();
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  at::Tensor out = at::empty({rows, 1}, lc.options().dtype(at::kDouble));
  const float* x = lc.data_ptr<float>();
  double* ids = out.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) ids[r] = greedy_row(x + r * vocab, vocab);
  return out;
}

// ---- one decoder layer of the Llama family for single-token rows ----------------------------
//
// Everything between two layers' residual streams in one call, so that a decode step costs one
// dispatch per layer instead of the ~120 small torch ops the same layer takes from Python:
//
//   x = rms_norm(h) * input_norm
//   q|k|v = x @ W_qkv.T (+ b)        k, v: the rows' new K/V, returned for the pool
//   q, k = rope(qk_norm(q), qk_norm(k))
//   h = h + attend(q, pages + own k/v) @ W_o.T (+ b)
//   x = rms_norm(h) * post_norm
//   h = h + (silu(x @ W_gate.T) * (x @ W_up.T)) @ W_down.T (+ b)     (gate|up fused)
//
// Weights come as float32 [out, in] (format 0) or blocks (1: Q4_1, 2: Q8_0); biases optional.
// The arithmetic is that of the torch layer (norms in float32, rotation by split halves), up
// to float rounding order.

constexpr int64_t kFloatWeight = 0, kQ41Weight = 1, kQ80Weight = 2;
constexpr int64_t kSmallBatchRows = 256;  // pdserve.models.layers._SMALL_BATCH_ROWS

at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                        const std::optional<at::Tensor>& bias) {
  at::Tensor out;
  if (format == kFloatWeight) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "decoder layer: float weights must be float32");
    const int64_t rows = x.size(0);
    // As pdserve.models.layers.linear: BLAS is faster with the weight on the left for a few rows.
    if (rows == 1) {
      out = f32_row_linear(x, weight);
    } else {
      out = rows <= kSmallBatchRows ? at::mm(weight, x.t()).t().contiguous() : at::mm(x, weight.t());
    }
  } else if (format == kQ41Weight) {
    out = q4_1_linear(x, weight);
  } else {
    TORCH_CHECK(format == kQ80Weight, "decoder layer: unknown weight format ", format);
    out = q8_0_linear(x, weight);
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, over rows of `width` floats.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t width, int64_t x_stride, float eps,
                   float* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* yr = out + r * out_stride;
    double squares = 0.0;
    for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(squares / width) + eps);
    for (int64_t i = 0; i < width; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

// Rotates each head of `x` [heads, head_dim] by split halves: [a, b] -> [a cos - b sin, b cos + a sin].
void rotate_heads(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* a = x + h * head_dim;
    float* b = a + half;
    for (int64_t i = 0; i < half; ++i) {
      const float ai = a[i], bi = b[i];
      a[i] = ai * cos[i] - bi * sin[i];
      b[i] = bi * cos[i] + ai * sin[i];
    }
  }
}

// Each row's new K/V into its slot of the pages (after attending, which reads other slots only).
void store_new_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& write_blocks, const at::Tensor& write_offsets) {
  const int64_t rows = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  TORCH_CHECK(write_blocks.scalar_type() == at::kLong && write_offsets.scalar_type() == at::kLong &&
                  write_blocks.numel() == rows && write_offsets.numel() == rows,
              "llama_decode_layer: one int64 write block and offset per row");
  const PagedCache keys = paged_cache(k_cache), values = paged_cache(v_cache);
  const at::Tensor blocks = write_blocks.contiguous(), offsets = write_offsets.contiguous();
  const int64_t* block_data = blocks.data_ptr<int64_t>();
  const int64_t* offset_data = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = block_data[r], offset = offset_data[r];
    TORCH_CHECK(block >= 0 && block < keys.num_blocks && offset >= 0 && offset < keys.block_size,
                "llama_decode_layer: write slot (", block, ", ", offset, ") of row ", r, " is outside the pool");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = block * keys.block_stride + offset * keys.token_stride + h * keys.head_stride;
      std::memcpy(const_cast<float*>(keys.data) + at, k.data_ptr<float>() + (r * kv_heads + h) * head_dim,
                  head_dim * sizeof(float));
      const int64_t vat = block * values.block_stride + offset * values.token_stride + h * values.head_stride;
      std::memcpy(const_cast<float*>(values.data) + vat, v.data_ptr<float>() + (r * kv_heads + h) * head_dim,
                  head_dim * sizeof(float));
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llama_decode_layer(
    const at::Tensor& h_in, at::TensorList norms, const std::optional<at::Tensor>& qk_norm, at::TensorList weights,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& key_start, const at::Tensor& key_end, const at::Tensor& write_blocks,
    const at::Tensor& write_offsets, at::IntArrayRef geometry, double eps, double scale) {
  TORCH_CHECK(norms.size() == 2 && weights.size() == 4 && formats.size() == 4 && biases.size() == 4,
              "llama_decode_layer: norms (input, post), weights, formats and biases (qkv, o, gate_up, down)");
  TORCH_CHECK(geometry.size() == 3, "llama_decode_layer: geometry is (heads, kv_heads, head_dim)");
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat, "llama_decode_layer: h must be float32 [rows, hidden]");
  const at::Tensor h = h_in.contiguous();
  const int64_t rows = h.size(0), hidden = h.size(1);
  const int64_t heads = geometry[0], kv_heads = geometry[1], head_dim = geometry[2];
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  TORCH_CHECK(head_dim % 2 == 0 && cos.size(-1) * 2 == head_dim && sin.sizes() == cos.sizes() &&
                  cos.numel() == rows * head_dim / 2 && cos.scalar_type() == at::kFloat,
              "llama_decode_layer: cos/sin must be float32 with half a head per row");
  for (const at::Tensor& norm : norms) {
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == hidden, "llama_decode_layer: norm weights");
  }
  const float epsf = static_cast<float>(eps);
  const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous();
  const at::Tensor input_norm = norms[0].contiguous(), post_norm = norms[1].contiguous();

  at::Tensor x = at::empty({rows, hidden}, h.options());
  rms_norm_rows(h.data_ptr<float>(), input_norm.data_ptr<float>(), rows, hidden, hidden, epsf, x.data_ptr<float>(),
                hidden);
  at::Tensor qkv = layer_linear(x, weights[0], formats[0], biases.get(0));
  TORCH_CHECK(qkv.size(1) == qkv_width, "llama_decode_layer: qkv weight has ", qkv.size(1), " rows, expected ",
              qkv_width);
  at::Tensor q = at::empty({rows, heads, head_dim}, h.options());
  at::Tensor k = at::empty({rows, kv_heads, head_dim}, h.options());
  at::Tensor v = at::empty({rows, kv_heads, head_dim}, h.options());
  const float* qkv_data = qkv.data_ptr<float>();
  float* q_data = q.data_ptr<float>();
  float* k_data = k.data_ptr<float>();
  float* v_data = v.data_ptr<float>();
  at::Tensor qk_norm_c;
  if (qk_norm.has_value() && qk_norm->defined()) {
    qk_norm_c = qk_norm->contiguous();
    TORCH_CHECK(qk_norm_c.scalar_type() == at::kFloat && qk_norm_c.numel() == (heads + kv_heads) * head_dim,
                "llama_decode_layer: qk_norm must be float32 [heads + kv_heads, head_dim]");
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = qkv_data + r * qkv_width;
    float* qr = q_data + r * q_width;
    float* kr = k_data + r * kv_width;
    if (qk_norm_c.defined()) {  // one weight row per head: q heads first, then k heads
      const float* w = qk_norm_c.data_ptr<float>();
      for (int64_t hd = 0; hd < heads; ++hd) {
        rms_norm_rows(src + hd * head_dim, w + hd * head_dim, 1, head_dim, head_dim, epsf, qr + hd * head_dim, head_dim);
      }
      for (int64_t hd = 0; hd < kv_heads; ++hd) {
        rms_norm_rows(src + q_width + hd * head_dim, w + (heads + hd) * head_dim, 1, head_dim, head_dim, epsf,
                      kr + hd * head_dim, head_dim);
      }
    } else {
      std::memcpy(qr, src, q_width * sizeof(float));
      std::memcpy(kr, src + q_width, kv_width * sizeof(float));
    }
    std::memcpy(v_data + r * kv_width, src + q_width + kv_width, kv_width * sizeof(float));
    const float* c = cosc.data_ptr<float>() + r * head_dim / 2;
    const float* s = sinc.data_ptr<float>() + r * head_dim / 2;
    rotate_heads(qr, heads, head_dim, c, s);
    rotate_heads(kr, kv_heads, head_dim, c, s);
  }
  const at::Tensor attended =
      paged_decode_attention(q, k_cache, v_cache, block_table, key_start, key_end, k, v, scale).view({rows, q_width});
  store_new_kv(k, v, k_cache, v_cache, write_blocks, write_offsets);
  at::Tensor out = layer_linear(attended, weights[1], formats[1], biases.get(1));
  TORCH_CHECK(out.size(1) == hidden, "llama_decode_layer: o weight does not give the hidden size");
  out.add_(h);  // the residual stream after attention
  rms_norm_rows(out.data_ptr<float>(), post_norm.data_ptr<float>(), rows, hidden, hidden, epsf, x.data_ptr<float>(),
                hidden);
  at::Tensor gate_up = layer_linear(x, weights[2], formats[2], biases.get(2));
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "llama_decode_layer: gate|up weight has an odd row count");
  const int64_t intermediate = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, intermediate}, h.options());
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {  // silu(gate) * up
    const float* gate = gu + r * 2 * intermediate;
    const float* up = gate + intermediate;
    float* out = a + r * intermediate;
    int64_t i = 0;
#if PDSERVE_AVX2
    for (; i + 8 <= intermediate; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < intermediate; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
  at::Tensor mlp = layer_linear(act, weights[3], formats[3], biases.get(3));
  TORCH_CHECK(mlp.size(1) == hidden, "llama_decode_layer: down weight does not give the hidden size");
  out.add_(mlp);
  return {out, k, v};
}

// ---- every decoder layer of a model in one call --------------------------------------------
//
// `llama_decode_layer` for each layer in turn, its fixed arguments (norms, weights, biases,
// geometry, its slot's page views and KV group) held here from start-up: a decode step then
// crosses from Python once, not once per layer (~30 us of argument conversion each on the CI
// machine, a tenth of a batch-1 step of the embedded model).
struct LlamaDecoderStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> norms, weights;
    std::optional<at::Tensor> qk_norm;
    std::vector<int64_t> formats, geometry;
    c10::List<std::optional<at::Tensor>> biases;
    at::Tensor k_cache, v_cache;
    int64_t group = 0;
    double eps = 0, scale = 0;
  };
  std::vector<Layer> layers;

  // biases: an empty tensor stands for none (a method argument cannot be a list of optionals).
  void add_layer(std::vector<at::Tensor> norms, std::optional<at::Tensor> qk_norm, std::vector<at::Tensor> weights,
                 std::vector<int64_t> formats, std::vector<at::Tensor> biases, std::vector<int64_t> geometry,
                 double eps, double scale, at::Tensor k_cache, at::Tensor v_cache, int64_t group) {
    TORCH_CHECK(biases.size() == 4, "LlamaDecoderStack.add_layer: four biases (empty for none)");
    Layer layer{std::move(norms), std::move(weights), std::move(qk_norm), std::move(formats), std::move(geometry),
                c10::List<std::optional<at::Tensor>>(), std::move(k_cache), std::move(v_cache), group, eps, scale};
    for (const at::Tensor& bias : biases) {
      layer.biases.push_back(bias.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(bias));
    }
    layers.push_back(std::move(layer));
  }

  // The residual stream after every layer; each layer's new K/V stored in its slot. Per KV group
  // g: block_tables[g], key_starts[g], key_ends[g], write_blocks[g]; write_offsets for all.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> key_starts, std::vector<at::Tensor> key_ends,
                     std::vector<at::Tensor> write_blocks, at::Tensor write_offsets) {
    for (const Layer& layer : layers) {
      const size_t g = static_cast<size_t>(layer.group);
      TORCH_CHECK(g < block_tables.size() && g < key_starts.size() && g < key_ends.size() && g < write_blocks.size(),
                  "LlamaDecoderStack.forward: no rows for KV group ", layer.group);
      h = std::get<0>(llama_decode_layer(h, layer.norms, layer.qk_norm, layer.weights, layer.formats, layer.biases,
                                         cos, sin, layer.k_cache, layer.v_cache, block_tables[g], key_starts[g],
                                         key_ends[g], write_blocks[g], write_offsets, layer.geometry, layer.eps,
                                         layer.scale));
    }
    return h;
  }
};

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.class_<LlamaDecoderStack>("LlamaDecoderStack")
      .def(torch::init<>())
      .def("add_layer", &LlamaDecoderStack::add_layer)
      .def("forward", &LlamaDecoderStack::forward);
  m.def("q4_1_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("f32_row_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("dequantize_blocks(Tensor blocks, int block_bytes) -> Tensor");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor key_start, "
      "Tensor key_end, Tensor? k_new, Tensor? v_new, float scale) -> Tensor");
  m.def(
      "llama_decode_layer(Tensor h, Tensor[] norms, Tensor? qk_norm, Tensor[] weights, int[] formats, "
      "Tensor?[] biases, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, "
      "Tensor key_start, Tensor key_end, Tensor write_blocks, Tensor write_offsets, int[] geometry, float eps, "
      "float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("f32_row_linear", &f32_row_linear);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("greedy_tokens", &greedy_tokens);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("llama_decode_layer", &llama_decode_layer);
}

}  // namespace pdserve
