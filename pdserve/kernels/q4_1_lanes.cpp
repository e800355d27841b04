// Q4_1 products for a batch of activation rows (a batched decode step), the rows laid across
// vector lanes and multiplied in integers against the 4-bit codes.
// Invariant: with 3 digits every activation is rounded as the one-row kernel rounds it
// (quantized_matmul.cpp's integer_row: per block of 32, s = max|x| / (2^21 - 1), q = round(x / s)),
// so a row's output differs from its batch-1 output only in the order of the float sums.
//
// Why lanes: the float tiles spend four FMAs per row and block; here one integer multiply-add
// (vpdpbusd, or maddubs + madd on AVX2) takes four weights of one output column against four
// activations of every row of the group at once, and each block's integer sums meet their
// float scales once per 16 (8) rows, not once per row.
//
// Activations of a group of L rows (L = 16 with AVX-512 VNNI, 8 with AVX2), per block g of k / 32,
// rounded to integers q = sum_d t_d 2^(7 (D - 1 - d)) in D 7-bit digits (t_0 signed, the rest in
// [0, 127]; D = 3 gives the one-row kernel's 22 bits, D = 1 llama.cpp's 8):
//
//   digits [group][g][digit t][quad j = 0..7]:  L lanes x 4 bytes  (one vector)
//   +-----------------------+-----------------------+-----+--------------------------+
//   | t of row 0, x[32g+4j] | t of row 1, x[32g+4j] | ... | t of row L-1, ...        |
//   |   .. x[32g+4j+3]      |   .. x[32g+4j+3]      |     |                          |
//   +-----------------------+-----------------------+-----+--------------------------+
//   scales [group][g]: L floats (each row's s),  sums [group][g]: L floats (each row's sum of x)
//   (rows past the batch are zero lanes: scale 0, sum 0, never stored)
//
// Weights: C output columns at a time, each unpacked once into its codes in weight order (4 per
// int32 word, so word 8g + j holds the codes of quad j of block g), d and m as floats. Then for
// column c and block g, digit by digit (the sum shifted left 7 bits between digits):
//
//   sums[lane r] += sum over quads j of  codes[c][8g + j] . digits[g][t][j][r]   (4 bytes each)
//   y[r][c] += d[c][g] s[r][g] sums[r] + m[c][g] sum_x[r][g]
//
// |sums| <= 32 * 15 * 2^21 < 2^31: no overflow at 22 bits.

#include "kernels.h"

#if PDSERVE_AVX2

namespace pdserve::kernels {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ41Bytes = 20;
constexpr int kQuads = 8;  // 4-byte words of one block's 32 codes or digits
// The dword order `_mm256_packs_*` leaves a block's 32 bytes in: dword i holds quad kPackedQuad[i].
constexpr int kPackedQuad[kQuads] = {0, 2, 4, 6, 1, 3, 5, 7};
// The fewest rows q4_1_linear gives the lanes, [digits - 1] (33: never, as on AVX2 past 32 rows a
// matmul over dequantized weights takes over); fewer run the float row tiles, as the lanes would idle
// more than the integer sums save. Measured (python -m bench.kernels q4-1, AVX-512 VNNI): 16 lanes
// at 22 bits 0.6-0.9x the float tiles at 8 rows, 1.0-1.3x at 12, 1.0-1.8x at 16; at 8 bits
// 1.3-1.8x at 8 rows. 8 lanes (AVX2) at 22 bits: 0.6-1.0x at any row count, so never.
constexpr int64_t kLanesMinRowsWide[3] = {8, 12, 12};
constexpr int64_t kLanesMinRowsNarrow[3] = {33, 33, 33};

template <int kDigits>
constexpr float lane_int_max() {
  return static_cast<float>((1 << (7 * kDigits)) - 1);
}

// ---- the activations, rounded and laid across lanes ------------------------------------------

struct LaneRows {
  std::vector<int8_t> digits;  // [groups][blocks][digits][quads][lanes][4]
  std::vector<float> scales;  // [groups][blocks][lanes]
  std::vector<float> sums;  // [groups][blocks][lanes]
  int64_t groups = 0, blocks = 0;
};

inline float block_abs_max(const float* x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 largest = _mm256_and_ps(_mm256_loadu_ps(x), abs_mask);
  for (int p = 1; p < 4; ++p) largest = _mm256_max_ps(largest, _mm256_and_ps(_mm256_loadu_ps(x + 8 * p), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float block_sum(const float* x) {
  const __m256 total = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
  return horizontal_sum(total);
}

// q = round(x * inverse) (to nearest even, as std::nearbyint), clamped to +-int_max; a NaN
// (an infinity times a zero inverse) becomes 0: the row's sum of x still carries it.
inline void round_block(const float* x, float inverse, float int_max, __m256i q[4]) {
  const __m256 by = _mm256_set1_ps(inverse), top = _mm256_set1_ps(int_max), bottom = _mm256_set1_ps(-int_max);
  for (int p = 0; p < 4; ++p) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * p), by);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
    q[p] = _mm256_cvtps_epi32(_mm256_min_ps(top, _mm256_max_ps(bottom, v)));
  }
}

// Digit `d` of a block's 32 integers as bytes, dword i holding quad kPackedQuad[i].
template <int kDigits>
inline __m256i block_digit(const __m256i q[4], int d) {
  const __m128i shift = _mm_cvtsi32_si128(7 * (kDigits - 1 - d));
  const __m256i low7 = _mm256_set1_epi32(127);
  __m256i v[4];
  for (int p = 0; p < 4; ++p) {
    const __m256i shifted = _mm256_sra_epi32(q[p], shift);  // arithmetic: the top digit keeps the sign
    v[p] = d == 0 ? shifted : _mm256_and_si256(shifted, low7);
  }
  // int32 -> int16 -> int8 within 128-bit halves: [q0-3 q8-11 q16-19 q24-27 | q4-7 q12-15 q20-23 q28-31]
  return _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
}

template <int kLanes, int kDigits>
constexpr int64_t group_digit_bytes() {  // one block's digits for one lane group
  return kDigits * kQuads * kLanes * 4;
}

// Row r's blocks (xr: its k activations) into its lane of `out`.
template <int kLanes, int kDigits>
void round_row(const float* xr, int64_t r, LaneRows& out) {
  constexpr float int_max = lane_int_max<kDigits>();
  const int64_t group = r / kLanes, lane = r % kLanes;
  for (int64_t g = 0; g < out.blocks; ++g) {
    const float* xs = xr + g * kGroup;
    const float largest = block_abs_max(xs);
    const float inverse = largest > 0.f ? int_max / largest : 0.f;
    __m256i q[4];
    round_block(xs, inverse, int_max, q);
    const int64_t at = group * out.blocks + g;
    out.scales[at * kLanes + lane] = largest / int_max;
    out.sums[at * kLanes + lane] = block_sum(xs);
    int8_t* digits = out.digits.data() + at * group_digit_bytes<kLanes, kDigits>() + lane * 4;
    for (int d = 0; d < kDigits; ++d) {
      alignas(32) int32_t words[kQuads];
      _mm256_store_si256(reinterpret_cast<__m256i*>(words), block_digit<kDigits>(q, d));
      for (int i = 0; i < kQuads; ++i) std::memcpy(digits + (d * kQuads + kPackedQuad[i]) * kLanes * 4, &words[i], 4);
    }
  }
}

template <int kLanes, int kDigits>
LaneRows lane_rows(const float* x, int64_t rows, int64_t k) {
  LaneRows out;
  out.blocks = k / kGroup;
  out.groups = (rows + kLanes - 1) / kLanes;
  out.digits.assign(out.groups * out.blocks * group_digit_bytes<kLanes, kDigits>(), 0);
  out.scales.assign(out.groups * out.blocks * kLanes, 0.f);
  out.sums.assign(out.groups * out.blocks * kLanes, 0.f);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {  // rows write disjoint lanes
    for (int64_t r = begin; r < end; ++r) round_row<kLanes, kDigits>(x + r * k, r, out);
  });
  return out;
}

// ---- the vector widths -----------------------------------------------------------------------

// AVX2: 8 rows a vector; vpmaddubsw (codes <= 15 times digits in [-128, 127], pairs: at most
// 3,840, no int16 saturation) then vpmaddwd by ones.
struct Ymm8 {
  static constexpr int kLanes = 8, kColumns = 4;  // 4 + 4 accumulators of 16 registers
  using Int = __m256i;
  using Float = __m256;
  static Int zero() { return _mm256_setzero_si256(); }
  static Float zero_f() { return _mm256_setzero_ps(); }
  static Int load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Float load_f(const float* p) { return _mm256_loadu_ps(p); }
  static Int dot(Int acc, int32_t codes, Int digits) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(codes), digits);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static Int next_digit(Int acc) { return _mm256_slli_epi32(acc, 7); }
  static Float add_block(Float acc, Int sums, Float scales, Float x_sums, float d, float m) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), scales), _mm256_set1_ps(d), acc);
    return _mm256_fmadd_ps(x_sums, _mm256_set1_ps(m), acc);
  }
  static void store(Float v, float* out) { _mm256_storeu_ps(out, v); }
};

#if PDSERVE_AVX512_VNNI
// AVX-512 VNNI: 16 rows a vector, one vpdpbusd per quad (codes unsigned, digits signed).
struct Zmm16 {
  static constexpr int kLanes = 16, kColumns = 8;  // 8 + 8 accumulators of 32 registers
  using Int = __m512i;
  using Float = __m512;
  static Int zero() { return _mm512_setzero_si512(); }
  static Float zero_f() { return _mm512_setzero_ps(); }
  static Int load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static Float load_f(const float* p) { return _mm512_loadu_ps(p); }
  static Int dot(Int acc, int32_t codes, Int digits) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(codes), digits); }
  static Int next_digit(Int acc) { return _mm512_slli_epi32(acc, 7); }
  static Float add_block(Float acc, Int sums, Float scales, Float x_sums, float d, float m) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), scales), _mm512_set1_ps(d), acc);
    return _mm512_fmadd_ps(x_sums, _mm512_set1_ps(m), acc);
  }
  static void store(Float v, float* out) { _mm512_storeu_ps(out, v); }
};
#endif

// ---- the weights, a tile of columns at a time --------------------------------------------------

// One column's (weight row's) blocks: codes in weight order, 4 to a word; d and m as floats.
void unpack_column(const uint8_t* row, int64_t blocks, int32_t* codes, float* d, float* m) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* block = row + g * kQ41Bytes;
    prefetch_weights_ahead(block);
    uint16_t halves[2];
    std::memcpy(halves, block, sizeof(halves));
    d[g] = _cvtsh_ss(halves[0]);
    m[g] = _cvtsh_ss(halves[1]);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 8 * g), _mm_and_si128(packed, nibble));  // codes 0..15
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 8 * g + 4),
                     _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));  // codes 16..31
  }
}

// y[r][col0 + c] for every row r and the tile's columns c < kColumns (those below n).
template <class V, int kDigits>
void column_tile(const LaneRows& x, int64_t rows, const int32_t* codes, const float* d, const float* m,
                 int64_t col0, int64_t n, float* y) {
  constexpr int L = V::kLanes, C = V::kColumns;
  const int64_t blocks = x.blocks, words = blocks * kQuads;
  for (int64_t group = 0; group < x.groups; ++group) {
    const int8_t* digits = x.digits.data() + group * blocks * kDigits * kQuads * L * 4;
    const float* scales = x.scales.data() + group * blocks * L;
    const float* x_sums = x.sums.data() + group * blocks * L;
    typename V::Float acc[C];
    for (int c = 0; c < C; ++c) acc[c] = V::zero_f();
    for (int64_t g = 0; g < blocks; ++g) {
      typename V::Int sums[C];
      for (int c = 0; c < C; ++c) sums[c] = V::zero();
      for (int t = 0; t < kDigits; ++t) {
        if (t > 0) {
          for (int c = 0; c < C; ++c) sums[c] = V::next_digit(sums[c]);
        }
        const int8_t* quads = digits + (g * kDigits + t) * kQuads * L * 4;
        for (int j = 0; j < kQuads; ++j) {
          const typename V::Int xv = V::load(quads + j * L * 4);
          for (int c = 0; c < C; ++c) sums[c] = V::dot(sums[c], codes[c * words + g * kQuads + j], xv);
        }
      }
      const typename V::Float s = V::load_f(scales + g * L), sx = V::load_f(x_sums + g * L);
      for (int c = 0; c < C; ++c) acc[c] = V::add_block(acc[c], sums[c], s, sx, d[c * blocks + g], m[c * blocks + g]);
    }
    const int64_t group_rows = std::min<int64_t>(L, rows - group * L);
    for (int c = 0; c < C && col0 + c < n; ++c) {
      alignas(64) float lanes[L];
      V::store(acc[c], lanes);
      for (int64_t r = 0; r < group_rows; ++r) y[(group * L + r) * n + col0 + c] = lanes[r];
    }
  }
}

template <class V, int kDigits>
at::Tensor lanes_linear(const at::Tensor& x, const at::Tensor& blocks) {
  constexpr int C = V::kColumns;
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  const LaneRows lanes = lane_rows<V::kLanes, kDigits>(x.data_ptr<float>(), rows, k);
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t num_blocks = lanes.blocks, words = num_blocks * kQuads, tiles = (n + C - 1) / C;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> codes(C * words);
    std::vector<float> d(C * num_blocks), m(C * num_blocks);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t col0 = tile * C;
      for (int c = 0; c < C; ++c) {
        if (col0 + c < n) {
          unpack_column(w + (col0 + c) * row_bytes, num_blocks, codes.data() + c * words, d.data() + c * num_blocks,
                        m.data() + c * num_blocks);
        } else {  // past the last column: zero weights, computed and never stored
          std::fill_n(codes.data() + c * words, words, 0);
          std::fill_n(d.data() + c * num_blocks, num_blocks, 0.f);
          std::fill_n(m.data() + c * num_blocks, num_blocks, 0.f);
        }
      }
      column_tile<V, kDigits>(lanes, rows, codes.data(), d.data(), m.data(), col0, n, y);
    }
  });
  return out;
}

template <class V>
at::Tensor lanes_linear_digits(const at::Tensor& x, const at::Tensor& blocks, int64_t digits) {
  switch (digits) {
    case 1: return lanes_linear<V, 1>(x, blocks);
    case 2: return lanes_linear<V, 2>(x, blocks);
    default: return lanes_linear<V, 3>(x, blocks);
  }
}

}  // namespace

std::vector<int64_t> q4_1_lane_widths() {
#if PDSERVE_AVX512_VNNI
  return {Zmm16::kLanes, Ymm8::kLanes};
#else
  return {Ymm8::kLanes};
#endif
}

int64_t q4_1_lanes_min_rows(int64_t digits) {
  const int64_t at = std::clamp<int64_t>(digits, 1, 3) - 1;
  return q4_1_lane_widths().front() == Ymm8::kLanes ? kLanesMinRowsNarrow[at] : kLanesMinRowsWide[at];
}

at::Tensor q4_1_lanes_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t lanes, int64_t digits) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "q4_1_lanes_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "q4_1_lanes_linear: activations must be float32 [rows, k]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "q4_1_lanes_linear: blocks must be uint8 [out, bytes]");
  TORCH_CHECK(x.size(1) % kGroup == 0 && blocks.size(1) == x.size(1) / kGroup * kQ41Bytes,
              "q4_1_lanes_linear: in_features must be a multiple of 32 and the blocks must match it");
  TORCH_CHECK(digits >= 1 && digits <= 3, "q4_1_lanes_linear: digits must be 1, 2 or 3, not ", digits);
  const std::vector<int64_t> widths = q4_1_lane_widths();
  TORCH_CHECK(std::find(widths.begin(), widths.end(), lanes) != widths.end(), "q4_1_lanes_linear: ", lanes,
              " lanes are not compiled for this CPU");
  const at::Tensor xc = x.contiguous(), wc = blocks.contiguous();
  if (xc.size(0) == 0 || wc.size(0) == 0) return at::empty({xc.size(0), wc.size(0)}, xc.options());
#if PDSERVE_AVX512_VNNI
  if (lanes == Zmm16::kLanes) return lanes_linear_digits<Zmm16>(xc, wc, digits);
#endif
  return lanes_linear_digits<Ymm8>(xc, wc, digits);
}

}  // namespace pdserve::kernels

#endif  // PDSERVE_AVX2
