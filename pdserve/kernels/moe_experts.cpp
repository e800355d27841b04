// A mixture-of-experts MLP in one call (moe_experts.h): route, group the (token, expert) pairs by
// expert, run each active expert once over all its rows in the int4/int8/float kernels.
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

#include "moe_experts.h"

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

// weight_linear, but float weights over a few rows (2 to 32) take the row-tiled kernel.
constexpr int64_t kTiledMaxRows = 32;

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                         const std::optional<at::Tensor>& bias) {
  if (format != 0 || x.size(0) <= 1 || x.size(0) > kTiledMaxRows) return weight_linear(x, weight, format, bias);
  at::Tensor out = f32_few_rows_linear(x, weight);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
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
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t first = starts[e], m = starts[e + 1] - first;
    if (m == 0) continue;
    at::Tensor rows = at::empty({m, hidden}, x.options());
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(rows.data_ptr<float>() + i * hidden, xs + (order[first + i] / k) * hidden, hidden * sizeof(float));
    }
    const std::optional<at::Tensor> gu_bias = gate_up_bias ? std::optional<at::Tensor>((*gate_up_bias)[e]) : std::nullopt;
    const std::optional<at::Tensor> d_bias = down_bias ? std::optional<at::Tensor>((*down_bias)[e]) : std::nullopt;
    const at::Tensor gu = expert_linear(rows, gate_up[e], format, gu_bias).contiguous();
    TORCH_CHECK(gu.size(1) % 2 == 0, "SparseMoeMlp: expert ", e, "'s gate|up has an odd row count");
    const int64_t width = gu.size(1) / 2;
    at::Tensor hidden_rows = at::empty({m, width}, x.options());
    gated_activation(gu.data_ptr<float>(), m, width, activation, alpha, limit, hidden_rows.data_ptr<float>());
    const at::Tensor y = expert_linear(hidden_rows, down[e], format, d_bias).contiguous();
    TORCH_CHECK(y.size(1) == hidden, "SparseMoeMlp: expert ", e, "'s down does not give the hidden size");
    const float* ys = y.data_ptr<float>();
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
