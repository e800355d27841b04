// How the few-row expert kernel (moe_experts.cpp) reads weight rows: float32, bfloat16 (widened
// in registers) and MXFP4 (decoded in registers), four rows of a tile at a time.
// Invariant: every format's weights reach the products as exact float32 values, so bfloat16 and
// MXFP4 experts give the float32 results of their widened weights bit for bit (the kernel adds
// the products in one order whatever the format).

#pragma once

#include "moe_experts.h"

namespace pdserve::kernels {

// ---- MXFP4 experts: the same products over 4-bit weights, decoded in registers ---------------
//
// gpt-oss ships its experts in MXFP4 (quant/mxfp4.py); kept so, a layer's experts are 17 bytes a
// 32 weights instead of 128 in float32. A weight row is whole groups, each its E8M0 scale byte
// then 16 bytes of E2M1 codes (value 2j the low nibble of byte j):
//
//   row j   | s | c0 c1 .. c15 | s | c0 .. c15 | ...      17 bytes per 32 weights
//   8 weights = 4 code bytes -> 8 nibbles -> |E2M1 value| * 2^(s - 127), bit 3 the sign
//
// Every decoded weight is exact in float32 (an E2M1 value times a power of two), and the kernel
// adds the same products in the same order as over the dequantized float32 rows: MXFP4 experts
// give the float path's results bit for bit, reading a seventh of the bytes.

// 2^(s - 127) for an E8M0 byte s < 255 (0 is the subnormal 2^-127; 255, NaN, is refused at load).
inline float e8m0_scale(uint8_t s) {
  if (s == 0) return 0x1p-127f;
  const uint32_t bits = static_cast<uint32_t>(s) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

inline float e2m1_value(uint8_t code) {
  constexpr float kMagnitudes[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (code & 8) ? -kMagnitudes[code & 7] : kMagnitudes[code & 7];
}

// One MXFP4 weight: value i of a row whose groups start at `row`.
inline float mxfp4_weight(const uint8_t* row, int64_t i) {
  const uint8_t* group = row + i / kMxfp4GroupValues * kMxfp4GroupBytes;
  const uint8_t byte = group[1 + i % kMxfp4GroupValues / 2];
  return e2m1_value(i % 2 ? byte >> 4 : byte & 15) * e8m0_scale(group[0]);
}

// Four weight rows side by side (addresses of each row's first weight), as the tile kernel reads them.
struct FloatTile {
  const float* row[4];
  float weight(int c, int64_t i) const { return row[c][i]; }
};

struct Mxfp4Tile {
  const uint8_t* row[4];
  float weight(int c, int64_t i) const { return mxfp4_weight(row[c], i); }
};

// A bfloat16 weight widened to float32 (exact: the top half of its bits).
inline float bfloat16_weight(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

struct Bfloat16Tile {
  const uint16_t* row[4];
  float weight(int c, int64_t i) const { return bfloat16_weight(row[c][i]); }
};

// An [n, k] weight matrix: float32 rows, or MXFP4 rows of k / 32 groups.
struct FloatRows {
  const float* w;
  int64_t k;
  float weight(int64_t j, int64_t i) const { return w[j * k + i]; }
  FloatTile tile(const int64_t* col) const {
    return {{w + col[0] * k, w + col[1] * k, w + col[2] * k, w + col[3] * k}};
  }
};

struct Mxfp4Rows {
  const uint8_t* w;
  int64_t k;
  int64_t row_bytes() const { return k / kMxfp4GroupValues * kMxfp4GroupBytes; }
  float weight(int64_t j, int64_t i) const { return mxfp4_weight(w + j * row_bytes(), i); }
  Mxfp4Tile tile(const int64_t* col) const {
    const int64_t bytes = row_bytes();
    return {{w + col[0] * bytes, w + col[1] * bytes, w + col[2] * bytes, w + col[3] * bytes}};
  }
};

struct Bfloat16Rows {
  const uint16_t* w;
  int64_t k;
  float weight(int64_t j, int64_t i) const { return bfloat16_weight(w[j * k + i]); }
  Bfloat16Tile tile(const int64_t* col) const {
    return {{w + col[0] * k, w + col[1] * k, w + col[2] * k, w + col[3] * k}};
  }
};

// Row j against x in plain order (the rows the vector tiles leave, and builds without AVX2).
template <typename Rows>
float row_dot(const Rows& rows, int64_t j, const float* x) {
  float total = 0.f;
  for (int64_t i = 0; i < rows.k; ++i) total = std::fma(rows.weight(j, i), x[i], total);
  return total;
}

#if PDSERVE_AVX2
// A tile's four rows read a group of `kValues` weights at a time: `slice(c, offset)` is row c's
// 8 weights at `offset` into the group that `Four(tile, i)` starts at weight i.
struct FloatFour {
  static constexpr int64_t kValues = 8;
  const float* at[4];
  FloatFour(const FloatTile& tile, int64_t i) {
    for (int c = 0; c < 4; ++c) at[c] = tile.row[c] + i;
  }
  __m256 slice(int c, int64_t) const { return _mm256_loadu_ps(at[c]); }
};

#if PDSERVE_AVX512F
// 16 weights a decode: the 8 code bytes' nibbles index a 16-entry table of the signed E2M1 values
// times the group's scale (one product per group, exact as in the 8-wide decode). The upper 8
// weights wait for the slice after (four_weight_rows asks for offsets 0, 8, 16, 24 in turn).
struct Mxfp4Four {
  static constexpr int64_t kValues = kMxfp4GroupValues;
  const uint8_t* codes[4];
  __m512 table[4];
  __m256 upper[4];
  Mxfp4Four(const Mxfp4Tile& tile, int64_t i) {
    const __m512 values = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f,
                                         -3.f, -4.f, -6.f);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* group = tile.row[c] + i / kValues * kMxfp4GroupBytes;
      table[c] = _mm512_mul_ps(values, _mm512_set1_ps(e8m0_scale(group[0])));
      codes[c] = group + 1;
    }
  }
  __m256 slice(int c, int64_t offset) {
    if (offset % 16 != 0) return upper[c];
    // Lanes 0-7 take the first 4 code bytes, lanes 8-15 the next 4; lane v's shift picks its nibble.
    const __m512i words = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes[c] + offset / 2))));
    const __m512i nibbles = _mm512_and_si512(
        _mm512_srlv_epi32(words, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28)),
        _mm512_set1_epi32(15));
    const __m512 weights = _mm512_permutexvar_ps(nibbles, table[c]);
    upper[c] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(weights), 1));
    return _mm512_castps512_ps256(weights);
  }
};
#else
struct Mxfp4Four {
  static constexpr int64_t kValues = kMxfp4GroupValues;
  const uint8_t* codes[4];
  __m256 scale[4];
  Mxfp4Four(const Mxfp4Tile& tile, int64_t i) {
    for (int c = 0; c < 4; ++c) {
      const uint8_t* group = tile.row[c] + i / kValues * kMxfp4GroupBytes;
      scale[c] = _mm256_set1_ps(e8m0_scale(group[0]));
      codes[c] = group + 1;
    }
  }
  __m256 slice(int c, int64_t offset) const {
    int32_t word;  // 8 codes, value v of the slice in bits 4v..4v+3
    std::memcpy(&word, codes[c] + offset / 2, sizeof(word));
    const __m256i nibbles = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15));
    const __m256 magnitudes = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256 magnitude = _mm256_mul_ps(_mm256_permutevar8x32_ps(magnitudes, nibbles), scale[c]);
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(nibbles, 3), 31);
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  }
};
#endif

// bfloat16 rows widened in registers (8 weights from 16 bytes): half float32's bytes, its bits.
struct Bfloat16Four {
  static constexpr int64_t kValues = 8;
  const uint16_t* at[4];
  Bfloat16Four(const Bfloat16Tile& tile, int64_t i) {
    for (int c = 0; c < 4; ++c) at[c] = tile.row[c] + i;
  }
  __m256 slice(int c, int64_t) const {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at[c]));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
};

template <typename Tile> struct FourOf;
template <> struct FourOf<FloatTile> { using type = FloatFour; };
template <> struct FourOf<Mxfp4Tile> { using type = Mxfp4Four; };
template <> struct FourOf<Bfloat16Tile> { using type = Bfloat16Four; };
#endif

}  // namespace pdserve::kernels
