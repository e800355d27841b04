// Linear layers over GGUF-style quantized blocks (Q4_1, Q8_0), and float32 one-row products.
// Invariant: weights are multiplied in the block format they are stored in (each block is expanded
// to floats in registers, never to a float copy in memory), in float32 like the dequantized model.
//
// Block formats (32 weights per block along the input dimension; d and m are IEEE half floats):
//
//   Q4_1  20 bytes  | d | m | qs[16] |   w[j] = d * (qs[j] & 15) + m,  w[j+16] = d * (qs[j] >> 4) + m
//   Q8_0  34 bytes  | d | qs[32]     |   w[j] = d * qs[j]            (qs signed)
//
// Activations are float32, except against Q4_1 blocks: one row (the batch-1 decode step) is
// rounded to 22-bit integers per block of 32, as fine as float32's own rounding, and multiplied
// in bytes (see `integer_row`); batches of q4_1_lanes_min_rows() rows or more are rounded the same
// way and multiplied across vector lanes (q4_1_lanes.cpp). 8-bit activations, as llama.cpp uses,
// cost the embedded model 3.7% of its top-1 agreement with its dequantized self.

#include "kernels.h"

namespace pdserve::kernels {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ41Bytes = 20;
constexpr int64_t kQ80Bytes = 34;
// Activation rows that share one unpacked weight block: 16 in 512-bit tiles (one accumulator a
// row: 16 of the 32 vector registers), 8 in 256-bit ones (16 registers).
constexpr int64_t kRowTile = PDSERVE_AVX512F ? 16 : 8;
// Past this many rows (prefill) a float matmul over the dequantized weight beats the block
// kernels: BLAS reuses each weight from cache across rows far better than a row tile can. The
// 512-bit tiles against dequantize + mm (gate|up and down, two threads, Xeon VM): 1.17-1.44x at
// 48-64 rows, 1.01-1.05x at 80, 0.97x at 96, 0.86-0.88x at 128; the 256-bit ones crossed at ~32.
constexpr int64_t kKernelMaxRows = PDSERVE_AVX512F ? 64 : 32;

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

}  // namespace

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

namespace {

#if PDSERVE_AVX2
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
    prefetch_weights_ahead(w + g * block_bytes);
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

#if PDSERVE_AVX512F
// The same tiles a 512-bit vector wide: a block's 32 weights in two vectors, in order (so the
// activations need no permutation), two FMAs a row and block where the 256-bit tile takes four.
// On two threads float32 FMAs bound the batched steps (b=16: ~130 GFLOP/s, near 256-bit peak).
struct WideBlockWeights {
  __m512 w[2];
};

inline WideBlockWeights load_q4_1_wide(const uint8_t* block) {
  const __m512 d = _mm512_set1_ps(half_to_float(read_u16(block)));
  const __m512 m = _mm512_set1_ps(half_to_float(read_u16(block + 2)));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
  const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));  // weights 0..15
  const __m512i high = _mm512_srli_epi32(bytes, 4);  // weights 16..31
  return WideBlockWeights{{_mm512_fmadd_ps(_mm512_cvtepi32_ps(low), d, m),
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), d, m)}};
}

inline WideBlockWeights load_q8_0_wide(const uint8_t* block) {
  const __m512 d = _mm512_set1_ps(half_to_float(read_u16(block)));
  WideBlockWeights out;
  for (int half = 0; half < 2; ++half) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * half));
    out.w[half] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d);
  }
  return out;
}

template <int kRows, WideBlockWeights (*kLoad)(const uint8_t*)>
void row_tile_wide(const uint8_t* w, int64_t block_bytes, const float* x, int64_t k, float* out, int64_t out_stride) {
  constexpr int kAccs = kRows <= 2 ? 2 : 1;  // independent FMA chains per row (32 vector registers)
  __m512 acc[kRows][kAccs];
  for (int r = 0; r < kRows; ++r) {
    for (int a = 0; a < kAccs; ++a) acc[r][a] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < k / kGroup; ++g) {
    prefetch_weights_ahead(w + g * block_bytes);
    const WideBlockWeights b = kLoad(w + g * block_bytes);
    for (int r = 0; r < kRows; ++r) {
      const float* xs = x + r * k + g * kGroup;
      for (int half = 0; half < 2; ++half) {
        acc[r][half % kAccs] = _mm512_fmadd_ps(b.w[half], _mm512_loadu_ps(xs + 16 * half), acc[r][half % kAccs]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m512 total = acc[r][0];
    for (int a = 1; a < kAccs; ++a) total = _mm512_add_ps(total, acc[r][a]);
    out[r * out_stride] = _mm512_reduce_add_ps(total);
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

// Whether the Q4_1 row tiles take activations in `to_lane_order` (the 256-bit tiles' block order).
constexpr bool kQ41TilesInLaneOrder = PDSERVE_AVX2 && !PDSERVE_AVX512F;

template <int kBlockBytes>
RowTileKernels row_tile_kernels() {
#if PDSERVE_AVX512F
  constexpr auto load = kBlockBytes == kQ41Bytes ? load_q4_1_wide : load_q8_0_wide;
  return []<int... kRowsLessOne>(std::integer_sequence<int, kRowsLessOne...>) {
    return RowTileKernels{{row_tile_wide<kRowsLessOne + 1, load>...}};
  }(std::make_integer_sequence<int, kRowTile>());
#elif PDSERVE_AVX2
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

}  // namespace

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
#if PDSERVE_AVX512F
    // The loop below 16 at a time, to the same integers: max_ps returns its second operand for a
    // NaN as std::max(-M, NaN) does, and cvtps rounds to nearest even as nearbyint does.
    for (int64_t half_block = 0; half_block < 2; ++half_block) {
      const __m512 scaled = _mm512_min_ps(
          _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xs + 16 * half_block), _mm512_set1_ps(inverse)),
                        _mm512_set1_ps(-kRowIntMax)),
          _mm512_set1_ps(kRowIntMax));
      const __m512i q = _mm512_cvtps_epi32(scaled);
      const __m512i low7 = _mm512_set1_epi32(127);
      int8_t* at = digits + half_block * 32 + half * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 14)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64),
                       _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srai_epi32(q, 7), low7)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 128), _mm512_cvtepi32_epi8(_mm512_and_si512(q, low7)));
    }
#else
    for (int64_t j = 0; j < kGroup; ++j) {
      const float scaled = std::min(kRowIntMax, std::max(-kRowIntMax, xs[j] * inverse));
      const int32_t q = std::isfinite(scaled) ? static_cast<int32_t>(std::nearbyint(scaled)) : 0;
      const int64_t at = (j / 16) * 32 + half * 16 + j % 16;
      digits[at] = static_cast<int8_t>(q >> 14);  // arithmetic shift: floor(q / 2^14)
      digits[64 + at] = static_cast<int8_t>((q >> 7) & 127);
      digits[128 + at] = static_cast<int8_t>(q & 127);
    }
#endif
    float* scales = row.scales.data() + pair * 16 + half * 4;
    for (int lane = 0; lane < 4; ++lane) {
      scales[lane] = largest / kRowIntMax;
      scales[8 + lane] = total / 4;
    }
  }
  return row;
}

namespace {

float q4_1_integer_dot(const uint8_t* w, const IntegerRow& row) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i by_2_14 = _mm256_set1_epi16(1 << 14), by_2_7 = _mm256_set1_epi16(1 << 7), by_1 = _mm256_set1_epi16(1);
  __m256 scaled = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
  for (int64_t p = 0; p < row.pairs; ++p) {
    const uint8_t* a = w + 2 * p * kQ41Bytes;
    prefetch_weights_ahead(a);
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

// float_tiles_only: the float row tiles for every row count (q4_1_linear_with's lanes 0).
// batch_digits: the activation digits of Q4_1 batches on the integer lanes (q4_1_batch_linear).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t block_bytes,
                        const RowTileKernels& kernels, const char* name, bool lane_order = false,
                        bool float_tiles_only = false, int64_t batch_digits = kOneRowDigits) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": activations must be float32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, name, ": blocks must be uint8 [out, bytes]");
  TORCH_CHECK(x.dim() == 2, name, ": activations must be [rows, in_features]");
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % kGroup == 0, name, ": in_features must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) == k / kGroup * block_bytes, name, ": blocks do not match in_features");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = blocks.contiguous();
  if (!float_tiles_only) {
    if (rows > kKernelMaxRows) return at::mm(xc, dequantize_blocks(wc, block_bytes).t());
#if PDSERVE_AVX2
    if (rows == 1 && block_bytes == kQ41Bytes && n > 0) return q4_1_integer_row_linear(xc, wc);
    // The lanes on one thread only: there they beat the float tiles (a b=16 step 1.09x), but with two
    // threads the tiles' products ran 1.3-2.6x faster than the lanes' (decode-ab --threads 2, 2026-11-28).
    if (block_bytes == kQ41Bytes && rows >= q4_1_lanes_min_rows(batch_digits) && n > 0 && at::get_num_threads() == 1) {
      return q4_1_lanes_linear(xc, wc, q4_1_lane_widths().front(), batch_digits);
    }
#endif
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const at::Tensor xl = lane_order ? to_lane_order(xc) : xc;
  const float* xs = xl.data_ptr<float>();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t row_bytes = wc.size(1);
  // A tile's activation rows are read once per weight row: past ~36 KiB of them (16 rows of more
  // than 576 floats) they spill from L1 and 8-row tiles run faster (down, k 1536, at b=16: 16-row
  // tiles 1.03x the 256-bit kernel, 8-row 1.35x; k 576: 16-row 1.50-1.55x, 8-row 1.21-1.29x).
  const bool rows_spill_l1 = k * kRowTile * static_cast<int64_t>(sizeof(float)) > (36 << 10);
  const int64_t tile_rows = rows_spill_l1 ? std::min<int64_t>(kRowTile, 8) : kRowTile;
  // Split the weight rows among threads: each thread streams its own slice of the weights once
  // per tile of activation rows; a slice of 64 weight rows stays in L2 across those tiles.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t col0 = begin; col0 < end; col0 += 64) {
      const int64_t col_end = std::min(end, col0 + 64);
      for (int64_t row0 = 0; row0 < rows; row0 += tile_rows) {
        const RowTileKernel kernel = kernels.by_rows[std::min(tile_rows, rows - row0) - 1];
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
      prefetch_weights_ahead(a + i);  // 128 bytes a step: both lines
      prefetch_weights_ahead(a + i + 16);
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

}  // namespace

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
  return q4_1_batch_linear(x, blocks, kOneRowDigits);
}

at::Tensor q4_1_batch_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t batch_digits) {
  static const RowTileKernels kernels = row_tile_kernels<kQ41Bytes>();
  return block_linear(x, blocks, kQ41Bytes, kernels, "q4_1_linear", kQ41TilesInLaneOrder, false, batch_digits);
}

at::Tensor q4_1_linear_with(const at::Tensor& x, const at::Tensor& blocks, int64_t lanes, int64_t digits) {
  if (lanes != 0) {
#if PDSERVE_AVX2
    return q4_1_lanes_linear(x, blocks, lanes, digits);
#else
    TORCH_CHECK(false, "q4_1_linear_with: integer lanes need AVX2");
#endif
  }
  static const RowTileKernels kernels = row_tile_kernels<kQ41Bytes>();
  return block_linear(x, blocks, kQ41Bytes, kernels, "q4_1_linear_with", kQ41TilesInLaneOrder, true);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks) {
  static const RowTileKernels kernels = row_tile_kernels<kQ80Bytes>();
  return block_linear(x, blocks, kQ80Bytes, kernels, "q8_0_linear");
}

}  // namespace pdserve::kernels
