// One activation row against Q4_1 blocks in integers, four blocks a 512-bit vector (AVX-512 VNNI):
// the batch-1 product of every Q4_1 layer on CPUs that have it (quantized_matmul.cpp's 256-bit
// kernel elsewhere).
// Invariant: the row is rounded exactly as quantized_matmul.cpp's integer_row rounds it (per block
// of 32, s = max|x| / (2^21 - 1), q = round(x / s), three 7-bit digits), so the two kernels differ
// only in the order of their float sums; the integer sums are exact.
//
// Why: at batch 1 a step streams the weights once, and the 256-bit kernel spends ~28 instructions a
// pair of blocks (maddubs, madd, the int16 pair sums); here vpdpbusd multiplies and sums four codes
// by four digits into an int32 lane in one instruction, four blocks at a time, so the loop keeps
// up with memory instead of trailing it. The row's rounding is vectorized too (it ran scalar,
// ~16 us a layer).
//
// A quad of blocks A, B, C, D (80 bytes of weights) is read as one vector of codes, each block's
// 16 code bytes in a 128-bit quarter: the low nibbles are codes 0..15, the high ones 16..31.
// The row's digits are laid out per quad to match, top digit first:
//
//   quad (384 bytes of digits, then 32 floats):
//   +-----------------+-----------------+-----------------+-----------------+-----------------+-----------------+
//   | t2, codes 0..15 | t2, 16..31      | t1, codes 0..15 | t1, 16..31      | t0, codes 0..15 | t0, 16..31      |
//   | A | B | C | D   | A | B | C | D   | A | B | C | D   | A | B | C | D   | A | B | C | D   | A | B | C | D   |
//   +-----------------+-----------------+-----------------+-----------------+-----------------+-----------------+
//   (each 64 bytes: 16 digits of each block)
//   +---------------------------+------------------------------------+
//   | s_A x4 s_B x4 s_C x4 s_D x4 | sum_A/4 x4 ... sum_D/4 x4          |   (a lane per 4 codes' sums)
//   +---------------------------+------------------------------------+
//
// The blocks past the last of a row (k / 32 not a multiple of 4) have zero digits, scales and
// sums, and their weights are never read (masked loads): nothing from the next row, no NaN from
// bytes that are not a scale.

#include "kernels.h"

#if PDSERVE_AVX512_VNNI_VBMI

namespace pdserve::kernels {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ41Bytes = 20;
constexpr int64_t kQuadBlocks = 4;
constexpr int64_t kQuadDigitBytes = 384;
constexpr float kIntMax = 2097151.f;  // 2^21 - 1: the one-row kernel's 22 bits

struct WideRow {
  std::vector<int8_t> digits;  // [quads, 384]
  std::vector<float> scales;  // [quads, 32]: 16 lanes of s, then 16 of sum / 4
  int64_t blocks = 0, quads = 0;
};

// One block g of 32 activations: its scale, its sum, and its integers in three digits.
void round_block(const float* x, int64_t g, WideRow& row) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  // A NaN makes the largest magnitude NaN here (the one-row kernel skips it): no integer and no
  // scale survive either way, and the row's outputs are NaN through the block's sum.
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float total = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  const float inverse = largest > 0.f ? kIntMax / largest : 0.f;
  const __m512 by = _mm512_set1_ps(inverse), top = _mm512_set1_ps(kIntMax), bottom = _mm512_set1_ps(-kIntMax);
  const __m512i low7 = _mm512_set1_epi32(127);
  const int64_t quad = g / kQuadBlocks, part = g % kQuadBlocks;
  int8_t* digits = row.digits.data() + quad * kQuadDigitBytes + part * 16;
  const __m512 halves[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {  // codes 0..15, then 16..31
    const __m512 scaled = _mm512_mul_ps(halves[h], by);
    const __mmask16 ordered = _mm512_cmp_ps_mask(scaled, scaled, _CMP_ORD_Q);
    const __m512 clamped = _mm512_maskz_mov_ps(ordered, _mm512_min_ps(top, _mm512_max_ps(bottom, scaled)));
    const __m512i q = _mm512_cvtps_epi32(clamped);  // to nearest even, as std::nearbyint
    const __m512i by_digit[3] = {_mm512_srai_epi32(q, 14),  // arithmetic: the top digit keeps the sign
                                 _mm512_and_si512(_mm512_srai_epi32(q, 7), low7), _mm512_and_si512(q, low7)};
    for (int t = 0; t < 3; ++t) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + (2 * t + h) * 64), _mm512_cvtepi32_epi8(by_digit[t]));
    }
  }
  float* scales = row.scales.data() + quad * 32 + part * 4;
  for (int lane = 0; lane < 4; ++lane) {
    scales[lane] = largest / kIntMax;
    scales[16 + lane] = total / 4;
  }
}

WideRow wide_row(const float* x, int64_t k) {
  WideRow row;
  row.blocks = k / kGroup;
  row.quads = (row.blocks + kQuadBlocks - 1) / kQuadBlocks;
  row.digits.assign(row.quads * kQuadDigitBytes, 0);
  row.scales.assign(row.quads * 32, 0.f);
  for (int64_t g = 0; g < row.blocks; ++g) round_block(x + g * kGroup, g, row);
  return row;
}

// Byte gathers over a quad's 80 bytes (the first 64 in one vector, the last 16 in another):
// kCodeBytes puts block i's 16 code bytes in quarter i; kScaleBytes / kOffsetBytes put block
// (lane / 4)'s d / m halves in 16-bit lane `lane` (the low 256 bits of the result).
struct QuadGathers {
  alignas(64) uint8_t codes[64];
  alignas(64) uint8_t scales[64];
  alignas(64) uint8_t offsets[64];
};

constexpr QuadGathers quad_gathers() {
  QuadGathers out{};
  for (int i = 0; i < 64; ++i) {
    out.codes[i] = static_cast<uint8_t>((i / 16) * kQ41Bytes + 4 + i % 16);  // >= 64: the second vector
    const int lane = (i / 2) % 16, block = lane / 4;
    out.scales[i] = static_cast<uint8_t>(block * kQ41Bytes + i % 2);
    out.offsets[i] = static_cast<uint8_t>(block * kQ41Bytes + 2 + i % 2);
  }
  return out;
}

constexpr QuadGathers kGathers = quad_gathers();

// y += the products of one quad of a weight row, `first` its bytes 0..63 and `last` 64..79,
// against the row's quad q.
inline void quad_product(__m512i first, __m512i last, const WideRow& row, int64_t q, __m512& scaled,
                         __m512& offsets) {
  const __m512i codes = _mm512_permutex2var_epi8(first, _mm512_load_si512(kGathers.codes), last);
  const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(_mm512_load_si512(kGathers.scales), first)));
  const __m512 m = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(_mm512_load_si512(kGathers.offsets), first)));
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i low = _mm512_and_si512(codes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
  const int8_t* digits = row.digits.data() + q * kQuadDigitBytes;
  __m512i by_digit[3];  // each lane at most 2 * 4 * 15 * 128: the shifted sum stays below 2^31
  for (int t = 0; t < 3; ++t) {
    by_digit[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(digits + 128 * t)),
                                      high, _mm512_loadu_si512(digits + 128 * t + 64));
  }
  const __m512i sums = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(by_digit[0], 14), _mm512_slli_epi32(by_digit[1], 7)),
                                        by_digit[2]);
  const float* scales = row.scales.data() + q * 32;
  scaled = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(scales)), d, scaled);
  offsets = _mm512_fmadd_ps(m, _mm512_loadu_ps(scales + 16), offsets);
}

// One weight row's product with the row. (Two or four weight rows at once, sharing each load of
// the row's digits, measured 1.0-1.5x slower: the vector registers run out.)
float wide_dot(const uint8_t* w, const WideRow& row) {
  constexpr int64_t kQuadBytes = kQuadBlocks * kQ41Bytes;
  __m512 scaled = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
  const int64_t full = row.blocks / kQuadBlocks;
  for (int64_t q = 0; q < full; ++q) {
    const uint8_t* quad = w + q * kQuadBytes;
    prefetch_weights_ahead(quad);  // a quad is 80 bytes: two lines ask for every line ahead
    prefetch_weights_ahead(quad + 64);
    quad_product(_mm512_loadu_si512(quad), _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quad + 64))),
                 row, q, scaled, offsets);
  }
  if (const int64_t rest = row.blocks - full * kQuadBlocks; rest > 0) {  // 1-3 blocks, <= 60 bytes
    const __mmask64 present = (__mmask64{1} << (rest * kQ41Bytes)) - 1;
    quad_product(_mm512_maskz_loadu_epi8(present, w + full * kQuadBytes), _mm512_setzero_si512(), row, full, scaled,
                 offsets);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(scaled, offsets));
}

}  // namespace

at::Tensor q4_1_wide_row_linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t k = x.size(1), n = blocks.size(0), row_bytes = blocks.size(1);
  const WideRow row = wide_row(x.data_ptr<float>(), k);
  at::Tensor out = at::empty({1, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) y[col] = wide_dot(w + col * row_bytes, row);
  });
  return out;
}

}  // namespace pdserve::kernels

#endif  // PDSERVE_AVX512_VNNI_VBMI
