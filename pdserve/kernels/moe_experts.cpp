// A mixture-of-experts MLP in one call (moe_experts.h): route, group the (token, expert) pairs by
// expert, run each active expert once over all its rows (float32, bfloat16 and MXFP4 weights in
// this file's few-row kernel, Q4_1/Q8_0 blocks in the block kernels).
// Invariant: an expert no token chose is never read, and a batch costs one gate|up and one down
// per active expert, never one per token.
//
//   ids [[3, 0], [0, 2], [3, 1]]        3 tokens, k = 2 (pairs p = 2 t + j)
//   pairs by expert (counting sort, token order kept within an expert):
//     expert 0: pairs 1, 2 (tokens 0, 1) | 1: pair 5 (token 2) | 2: pair 3 (token 1) | 3: pairs 0, 4
//   expert e: rows = x[its tokens] -> gate|up -> activation -> down -> out[token] += w * row
//
// Experts run in ascending order, so each token's sum is added in ascending expert order, as the
// torch path (pdserve.models.moe.run_by_expert) adds it.

#include "expert_rows.h"

#include <type_traits>

namespace pdserve::kernels {
namespace {

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t.contiguous()) : std::nullopt;
}

// softmax over v[0..n) in place, in float32 (max subtracted first).
void softmax_in_place(float* v, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, v[i]);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    v[i] = std::exp(v[i] - top);
    total += v[i];
  }
  for (int64_t i = 0; i < n; ++i) v[i] /= total;
}

// The indices of the k largest of v[0..n), largest first (ties: the lower index first).
void top_k_indices(const float* v, int64_t n, int64_t k, int64_t* out) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  std::copy(order.begin(), order.begin() + k, out);
}

// hidden [m, I] from gate|up [m, 2I] (gate columns first).
void gated_activation(const float* gate_up, int64_t m, int64_t width, int64_t kind, float alpha, float limit,
                      float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* gate = gate_up + r * 2 * width;
    const float* up = gate + width;
    float* o = out + r * width;
    int64_t i = 0;
    if (kind == SparseMoeMlp::kSiluAndMul) {
#if PDSERVE_AVX2
      for (; i + 8 <= width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                              _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    } else {
#if PDSERVE_AVX2
      const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), a = _mm256_set1_ps(alpha);
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= width; i += 8) {
        // min/max return their second operand when either is NaN: the order keeps a NaN.
        const __m256 g = _mm256_min_ps(hi, _mm256_loadu_ps(gate + i));
        const __m256 u = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(up + i)));
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, a)));
        const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
      }
#endif
      for (; i < width; ++i) {
        const float g = std::isnan(gate[i]) ? gate[i] : std::min(gate[i], limit);
        const float u = std::isnan(up[i]) ? up[i] : std::max(-limit, std::min(up[i], limit));
        o[i] = (u + 1.f) * (g / (1.f + std::exp(-g * alpha)));
      }
    }
  }
}

// ---- float32, bfloat16 and MXFP4 experts: a few token rows against each weight row ----------
// (the formats' row readers: expert_rows.h)
//
// At batch 16 over 32 experts top-4 an expert gets ~2 rows: its products are thin and cost the
// stream of its weights from memory (a float32 gpt-oss-shaped layer reads ~29 of its 32 experts,
// 43 MB, against the dense MLP's 6 MB; in MXFP4, 6 MB). So the kernel reads each weight row once for all the
// expert's rows, four weight rows at a time, each 8-float slice of a token row loaded once for
// the four; results go, bias added, into the caller's buffers (no tensor, no dispatch per
// product: 29 experts x 2 products a layer). Software prefetch measured slower here:
//
//   weight rows j, j+q, j+2q, j+3q (q = n/4)      token rows r < kRows (at most 4)
//   acc[r][c] += w[j+cq][i..i+8) * x[r][i..i+8)     4 kRows accumulators of 8 lanes
//   out[r][j+cq] = bias[j+cq] + (sum of acc[r][c]'s lanes)

constexpr int kTokenTile = 4;  // token rows per pass over a tile of four weight rows (it stays in L1)

#if PDSERVE_AVX2
// [sum of a's lanes, b's, c's, d's].
inline __m128 lane_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// out[r][col[c]] for r < kRows and c < 4: token row x[r] against the tile's row c (k weights each).
template <int kRows, typename Tile>
void four_weight_rows(const Tile& tile, int64_t k, const int64_t* col, const float* const* x, const float* bias,
                      float* const* out) {
  using Four = typename FourOf<Tile>::type;
  __m256 acc[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  int64_t i = 0;
  for (; i + Four::kValues <= k; i += Four::kValues) {
    Four four(tile, i);
#pragma GCC unroll 4
    for (int64_t offset = 0; offset < Four::kValues; offset += 8) {
      __m256 xs[kRows];
      for (int r = 0; r < kRows; ++r) xs[r] = _mm256_loadu_ps(x[r] + i + offset);
      for (int c = 0; c < 4; ++c) {
        const __m256 wc = four.slice(c, offset);
        for (int r = 0; r < kRows; ++r) acc[r][c] = _mm256_fmadd_ps(wc, xs[r], acc[r][c]);
      }
    }
  }
  const __m128 b = bias != nullptr ? _mm_setr_ps(bias[col[0]], bias[col[1]], bias[col[2]], bias[col[3]])
                                   : _mm_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, _mm_add_ps(lane_sums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));
    for (int c = 0; c < 4; ++c) {  // + the tail past the last whole group (float rows only: k % 8)
      float tail = 0.f;
      for (int64_t t = i; t < k; ++t) tail = std::fma(tile.weight(c, t), x[r][t], tail);
      out[r][col[c]] = sums[c] + tail;
    }
  }
}

template <typename Tile>
using FourRowsKernel = void (*)(const Tile&, int64_t, const int64_t*, const float* const*, const float*,
                                float* const*);
template <typename Tile>
constexpr FourRowsKernel<Tile> kFourRows[kTokenTile] = {four_weight_rows<1, Tile>, four_weight_rows<2, Tile>,
                                                        four_weight_rows<3, Tile>, four_weight_rows<4, Tile>};

// All m token rows against one tile, kTokenTile rows a pass.
template <typename Tile>
void tile_product(const Tile& tile, int64_t k, const int64_t* col, const float* const* x, int64_t m,
                  const float* bias, float* const* out) {
  for (int64_t r0 = 0; r0 < m; r0 += kTokenTile) {
    kFourRows<Tile>[std::min<int64_t>(kTokenTile, m - r0) - 1](tile, k, col, x + r0, bias, out + r0);
  }
}

// An MXFP4 tile's four rows decoded into float32 rows at `into` (4 x k floats): the exact
// weights, so the float tile kernel over them gives the MXFP4 kernel's bits.
FloatTile decoded(const Mxfp4Tile& tile, int64_t k, float* into) {
  for (int64_t i = 0; i < k; i += Mxfp4Four::kValues) {
    Mxfp4Four four(tile, i);
    for (int64_t offset = 0; offset < Mxfp4Four::kValues; offset += 8) {
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(into + c * k + i + offset, four.slice(c, offset));
    }
  }
  return {{into, into + k, into + 2 * k, into + 3 * k}};
}
#endif

// One expert's product: out[r][0..n) = bias + x[r] @ w.T for its m token rows x[r] (k floats each).
template <typename Rows>
struct RowProduct {
  Rows rows;  // w [n, k]
  const float* const* x;
  int64_t m;
  const float* bias;
  float* const* out;
};

// Every product in `products` (all [n, k]) in one parallel region: a step's active experts share
// one hand-off to the threads instead of one each (at batch 1 the eight hand-offs of a layer's
// four experts took as long as their arithmetic).
// The four weight rows of a tile come one from each quarter of w: four streams that each walk
// their quarter front to back, which the hardware prefetcher follows (four rows side by side
// would start four short streams every 8 KB, and the read ran a third slower). MXFP4 rows that
// more than one pass of token rows reads (prefill) are decoded once into an L1-sized scratch:
// decoding them again for every pass cost prefill a third of its speed against float32.
template <typename Rows>
void row_products(const std::vector<RowProduct<Rows>>& products, int64_t n) {
  int64_t done = 0;
#if PDSERVE_AVX2
  const int64_t quarter = n / 4;
  // The threads split the quarters (each walks its share of the four streams): on one thread an
  // expert streamed its weights at a third of the bandwidth two threads reach.
  const int64_t num_tiles = quarter * static_cast<int64_t>(products.size());
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const RowProduct<Rows>& p = products[t / quarter];
      const int64_t j = t % quarter, k = p.rows.k;
      const int64_t col[4] = {j, j + quarter, j + 2 * quarter, j + 3 * quarter};
      const auto tile = p.rows.tile(col);
      if constexpr (std::is_same_v<Rows, Mxfp4Rows>) {
        if (p.m > kTokenTile) {
          scratch.resize(4 * k);
          tile_product(decoded(tile, k, scratch.data()), k, col, p.x, p.m, p.bias, p.out);
          continue;
        }
      }
      tile_product(tile, k, col, p.x, p.m, p.bias, p.out);
    }
  });
  done = 4 * quarter;
#endif
  for (const RowProduct<Rows>& p : products) {
    for (int64_t j = done; j < n; ++j) {
      for (int64_t r = 0; r < p.m; ++r) {
        p.out[r][j] = (p.bias != nullptr ? p.bias[j] : 0.f) + row_dot(p.rows, j, p.x[r]);
      }
    }
  }
}

// Scratch for the row-product path: one row per (token, expert) pair, in the pairs' sorted order
// (an expert's rows one after another).
struct ExpertBuffers {
  std::vector<const float*> inputs, hidden_inputs;
  std::vector<float*> gate_up_rows, output_rows;
  std::vector<float> gate_up, hidden, output;
};

ExpertBuffers row_buffers(int64_t num_rows, int64_t hidden, int64_t width) {
  ExpertBuffers b;
  b.inputs.resize(num_rows);
  b.gate_up.resize(num_rows * 2 * width);
  b.hidden.resize(num_rows * width);
  b.output.resize(num_rows * hidden);
  for (int64_t i = 0; i < num_rows; ++i) {
    b.gate_up_rows.push_back(b.gate_up.data() + i * 2 * width);
    b.hidden_inputs.push_back(b.hidden.data() + i * width);
    b.output_rows.push_back(b.output.data() + i * hidden);
  }
  return b;
}

template <typename Rows>
Rows rows_of(const at::Tensor& weight, int64_t k) {
  if constexpr (std::is_same_v<Rows, Mxfp4Rows>) {
    return Rows{weight.data_ptr<uint8_t>(), k};
  } else if constexpr (std::is_same_v<Rows, Bfloat16Rows>) {
    return Rows{reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), k};
  } else {
    return Rows{weight.data_ptr<float>(), k};
  }
}

// Every expert with rows (starts[e] .. starts[e + 1] of b's rows, b.inputs set) with float32,
// bfloat16 or MXFP4 weights: all gate|up products, the activation, all down products, into b.output.
template <typename Rows>
void run_row_experts(const SparseMoeMlp& moe, const std::vector<int64_t>& starts, int64_t hidden, ExpertBuffers& b) {
  const int64_t width = moe.expert_width, num_rows = starts.back();
  std::vector<RowProduct<Rows>> gate_ups, downs;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t first = starts[e], m = starts[e + 1] - first;
    if (m == 0) continue;
    const float* gate_up_bias = moe.gate_up_bias ? moe.gate_up_bias->data_ptr<float>() + e * 2 * width : nullptr;
    const float* down_bias = moe.down_bias ? moe.down_bias->data_ptr<float>() + e * hidden : nullptr;
    gate_ups.push_back({rows_of<Rows>(moe.gate_up[e], hidden), b.inputs.data() + first, m, gate_up_bias,
                        b.gate_up_rows.data() + first});
    downs.push_back({rows_of<Rows>(moe.down[e], width), b.hidden_inputs.data() + first, m, down_bias,
                     b.output_rows.data() + first});
  }
  row_products(gate_ups, 2 * width);
  gated_activation(b.gate_up.data(), num_rows, width, moe.activation, moe.alpha, moe.limit, b.hidden.data());
  row_products(downs, hidden);
}

// Expert e over its m rows with weights in blocks: the rows gathered into a tensor for the block
// kernels; the expert's outputs [m, hidden].
at::Tensor run_block_expert(const SparseMoeMlp& moe, int64_t e, const float* const* inputs, int64_t m, int64_t hidden,
                            const at::TensorOptions& options) {
  at::Tensor rows = at::empty({m, hidden}, options);
  for (int64_t i = 0; i < m; ++i) std::memcpy(rows.data_ptr<float>() + i * hidden, inputs[i], hidden * sizeof(float));
  const auto bias_of = [e](const std::optional<at::Tensor>& biases) {
    return biases ? std::optional<at::Tensor>((*biases)[e]) : std::nullopt;
  };
  const at::Tensor gu = weight_linear(rows, moe.gate_up[e], moe.format, bias_of(moe.gate_up_bias)).contiguous();
  TORCH_CHECK(gu.size(1) % 2 == 0, "SparseMoeMlp: expert ", e, "'s gate|up has an odd row count");
  const int64_t width = gu.size(1) / 2;
  at::Tensor hidden_rows = at::empty({m, width}, options);
  gated_activation(gu.data_ptr<float>(), m, width, moe.activation, moe.alpha, moe.limit, hidden_rows.data_ptr<float>());
  at::Tensor y = weight_linear(hidden_rows, moe.down[e], moe.format, bias_of(moe.down_bias)).contiguous();
  TORCH_CHECK(y.size(1) == hidden, "SparseMoeMlp: expert ", e, "'s down does not give the hidden size");
  return y;
}

}  // namespace

SparseMoeMlp::SparseMoeMlp(at::Tensor router_weight_in, at::Tensor router_bias_in, std::vector<at::Tensor> gate_up_in,
                           std::vector<at::Tensor> down_in, int64_t format_in, at::Tensor gate_up_bias_in,
                           at::Tensor down_bias_in, std::vector<int64_t> routing_in, std::vector<double> activation_in)
    : router_weight(std::move(router_weight_in)),
      router_bias(present(router_bias_in)),
      gate_up(std::move(gate_up_in)),
      down(std::move(down_in)),
      format(format_in),
      gate_up_bias(present(gate_up_bias_in)),
      down_bias(present(down_bias_in)) {
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(num_experts > 0 && down.size() == gate_up.size(), "SparseMoeMlp: one gate|up and one down per expert");
  TORCH_CHECK(routing_in.size() == 2 && activation_in.size() == 3,
              "SparseMoeMlp: routing is (top_k, rule), activation (kind, alpha, limit)");
  top_k = routing_in[0];
  routing = routing_in[1];
  activation = static_cast<int64_t>(activation_in[0]);
  alpha = static_cast<float>(activation_in[1]);
  limit = static_cast<float>(activation_in[2]);
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "SparseMoeMlp: top_k must be in [1, experts]");
  TORCH_CHECK(routing >= kTopKThenSoftmax && routing <= kSoftmaxThenTopKRenormalized, "SparseMoeMlp: unknown routing");
  TORCH_CHECK(activation == kSiluAndMul || activation == kClampedSwiglu, "SparseMoeMlp: unknown activation");
  if (router_weight.numel() > 0) {
    router_weight = router_weight.contiguous();
    TORCH_CHECK(router_weight.scalar_type() == at::kFloat && router_weight.dim() == 2 &&
                    router_weight.size(0) == num_experts,
                "SparseMoeMlp: the router must be float32 [experts, hidden]");
  }
  TORCH_CHECK(!gate_up_bias || (gate_up_bias->scalar_type() == at::kFloat && gate_up_bias->size(0) == num_experts),
              "SparseMoeMlp: gate|up biases must be float32 [experts, 2I]");
  TORCH_CHECK(!down_bias || (down_bias->scalar_type() == at::kFloat && down_bias->size(0) == num_experts),
              "SparseMoeMlp: down biases must be float32 [experts, hidden]");
  TORCH_CHECK(format >= kFloat32 && format <= kBfloat16, "SparseMoeMlp: unknown weight format ", format);
  if (reads_rows()) {  // the row path reads raw rows: one shape, checked here
    const bool mxfp4 = format == kMxfp4;
    const at::ScalarType type = mxfp4 ? at::kByte : format == kBfloat16 ? at::kBFloat16 : at::kFloat;
    for (int64_t e = 0; e < num_experts; ++e) {
      TORCH_CHECK(gate_up[e].scalar_type() == type && down[e].scalar_type() == type && gate_up[e].dim() == 2 &&
                      down[e].dim() == 2 && gate_up[e].sizes() == gate_up[0].sizes() &&
                      down[e].sizes() == down[0].sizes(),
                  "SparseMoeMlp: row experts must be all float32, all bfloat16 or all MXFP4 bytes, of one shape");
      gate_up[e] = gate_up[e].contiguous();
      down[e] = down[e].contiguous();
    }
    TORCH_CHECK(gate_up[0].size(0) % 2 == 0, "SparseMoeMlp: gate|up must have gate rows then as many up rows");
    expert_width = gate_up[0].size(0) / 2;
    const int64_t hidden = down[0].size(0);
    // A row of k weights: k floats, or k / 32 groups of 17 bytes.
    const auto row_units = [mxfp4](int64_t k) { return mxfp4 ? k / kMxfp4GroupValues * kMxfp4GroupBytes : k; };
    TORCH_CHECK(!mxfp4 || (hidden % kMxfp4GroupValues == 0 && expert_width % kMxfp4GroupValues == 0),
                "SparseMoeMlp: MXFP4 experts need widths in whole 32-weight groups");
    TORCH_CHECK(gate_up[0].size(1) == row_units(hidden) && down[0].size(1) == row_units(expert_width),
                "SparseMoeMlp: gate|up must be [2I, hidden] and down [hidden, I]");
    TORCH_CHECK(!gate_up_bias || gate_up_bias->size(-1) == 2 * expert_width,
                "SparseMoeMlp: gate|up biases must be [experts, 2I]");
    TORCH_CHECK(!down_bias || down_bias->size(-1) == hidden, "SparseMoeMlp: down biases must be [experts, hidden]");
  }
}

std::tuple<at::Tensor, at::Tensor> SparseMoeMlp::route(const at::Tensor& x) {
  TORCH_CHECK(router_weight.numel() > 0, "SparseMoeMlp.route: built without a router");
  const at::Tensor logits = weight_linear(x.contiguous(), router_weight, 0, router_bias).contiguous();
  const int64_t n = logits.size(0), num_experts = logits.size(1);
  at::Tensor weights = at::empty({n, top_k}, logits.options());
  at::Tensor ids = at::empty({n, top_k}, logits.options().dtype(at::kLong));
  std::vector<float> row(num_experts);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(logits.data_ptr<float>() + t * num_experts, num_experts, row.data());
    int64_t* id = ids.data_ptr<int64_t>() + t * top_k;
    float* w = weights.data_ptr<float>() + t * top_k;
    if (routing == kTopKThenSoftmax) {
      top_k_indices(row.data(), num_experts, top_k, id);
      for (int64_t j = 0; j < top_k; ++j) w[j] = row[id[j]];
      softmax_in_place(w, top_k);
    } else {
      softmax_in_place(row.data(), num_experts);
      top_k_indices(row.data(), num_experts, top_k, id);
      float total = 0.f;
      for (int64_t j = 0; j < top_k; ++j) total += (w[j] = row[id[j]]);
      if (routing == kSoftmaxThenTopKRenormalized) {
        for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
      }
    }
  }
  return {weights, ids};
}

at::Tensor SparseMoeMlp::run_experts(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& ids_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "SparseMoeMlp: x must be float32 [n, hidden]");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous(), weights = weights_in.to(at::kFloat).contiguous();
  const int64_t n = x.size(0), hidden = x.size(1), num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == n && weights.sizes() == ids.sizes(),
              "SparseMoeMlp: weights and ids must be [n, k]");
  const int64_t k = ids.size(1), num_pairs = n * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  // Counting sort of the pairs by expert; within an expert, pairs keep token order.
  std::vector<int64_t> starts(num_experts + 1, 0), order(num_pairs);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "SparseMoeMlp: expert id ", id[p], " out of range");
    ++starts[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) order[fill[id[p]]++] = p;

  at::Tensor out = at::empty({n, hidden}, x.options());
  out.zero_();
  float* o = out.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const bool row_weights = reads_rows();
  TORCH_CHECK(!row_weights || down[0].size(0) == hidden, "SparseMoeMlp: x's width is not the experts' hidden size");
  ExpertBuffers buffers = row_buffers(num_pairs, row_weights ? hidden : 0, row_weights ? expert_width : 0);
  for (int64_t s = 0; s < num_pairs; ++s) buffers.inputs[s] = xs + (order[s] / k) * hidden;
  if (format == kMxfp4) {
    run_row_experts<Mxfp4Rows>(*this, starts, hidden, buffers);
  } else if (format == kBfloat16) {
    run_row_experts<Bfloat16Rows>(*this, starts, hidden, buffers);
  } else if (format == kFloat32) {
    run_row_experts<FloatRows>(*this, starts, hidden, buffers);
  }
  for (int64_t e = 0; e < num_experts; ++e) {  // ascending experts: each token's sum in their order
    const int64_t first = starts[e], m = starts[e + 1] - first;
    if (m == 0) continue;
    at::Tensor block_outputs;  // holds the block path's outputs while they are added in
    const float* ys = buffers.output.data() + first * hidden;
    if (!row_weights) {
      block_outputs = run_block_expert(*this, e, buffers.inputs.data() + first, m, hidden, x.options());
      ys = block_outputs.data_ptr<float>();
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t pair = order[first + i];
      float* dst = o + (pair / k) * hidden;
      const float* src = ys + i * hidden;
      const float scale = w[pair];
      for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c] * scale;
    }
  }
  return out;
}

at::Tensor SparseMoeMlp::forward(const at::Tensor& x) {
  const auto [weights, ids] = route(x);
  return run_experts(x, weights, ids);
}

}  // namespace pdserve::kernels
