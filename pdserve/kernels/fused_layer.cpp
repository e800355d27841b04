// One Llama-family decoder layer for single-token rows in one call, and the stack of them (whose
// layers may also carry attention sinks and a mixture of experts: gpt-oss, Qwen3-MoE).
// Invariant: the arithmetic is the torch layer's (pdserve.models.layers), up to float rounding
// order; each row's new K/V goes into its own page slot only after every row has attended.

#include "fused_layer.h"
#include "kv_elements.h"

#include <chrono>
#include <ctime>

namespace pdserve::kernels {

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

namespace {

constexpr int64_t kFloatWeight = 0, kQ41Weight = 1, kQ80Weight = 2;
constexpr int64_t kSmallBatchRows = 256;  // pdserve.models.layers._SMALL_BATCH_ROWS
// Rows up to which a weight's one-row tiles beat its blocks (q4_1_row_tiles.cpp, measured there).
constexpr int64_t kTiledMaxRows = 2;

// Weights come as (qkv, o, gate_up, down), or those four then their one-row tiles (an undefined
// tensor where a weight has none): LlamaDecoderStack's layers, which make the tiles at start-up.
const at::Tensor* row_tiles_of(at::TensorList weights, size_t index) {
  return weights.size() == 8 ? &weights[4 + index] : nullptr;
}

}  // namespace

at::Tensor weight_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                        const std::optional<at::Tensor>& bias, int64_t batch_digits, const at::Tensor* row_tiles) {
  at::Tensor out;
  if (row_tiles != nullptr && row_tiles->defined() && x.size(0) <= kTiledMaxRows) {
    out = q4_1_tiled_linear(x, *row_tiles);
  } else if (format == kFloatWeight) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "decoder layer: float weights must be float32");
    const int64_t rows = x.size(0);
    // As pdserve.models.layers.linear: BLAS is faster with the weight on the left for a few rows.
    if (rows == 1) {
      out = f32_row_linear(x, weight);
    } else {
      out = rows <= kSmallBatchRows ? at::mm(weight, x.t()).t().contiguous() : at::mm(x, weight.t());
    }
  } else if (format == kQ41Weight) {
    out = q4_1_batch_linear(x, weight, batch_digits);
  } else {
    TORCH_CHECK(format == kQ80Weight, "decoder layer: unknown weight format ", format);
    out = q8_0_linear(x, weight);
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

namespace {

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
  TORCH_CHECK(keys.dtype == values.dtype, "llama_decode_layer: K and V caches of one dtype");
  const at::Tensor blocks = write_blocks.contiguous(), offsets = write_offsets.contiguous();
  const int64_t* block_data = blocks.data_ptr<int64_t>();
  const int64_t* offset_data = offsets.data_ptr<int64_t>();
  with_kv_element(keys.dtype, "llama_decode_layer", [&](auto element) {
    using T = decltype(element);  // the pool's element: float32 K/V converted on the way in
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t block = block_data[r], offset = offset_data[r];
      TORCH_CHECK(block >= 0 && block < keys.num_blocks && offset >= 0 && offset < keys.block_size,
                  "llama_decode_layer: write slot (", block, ", ", offset, ") of row ", r, " is outside the pool");
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = block * keys.block_stride + offset * keys.token_stride + h * keys.head_stride;
        store_elements(keys.elements<T>() + at, k.data_ptr<float>() + (r * kv_heads + h) * head_dim, head_dim);
        const int64_t vat = block * values.block_stride + offset * values.token_stride + h * values.head_stride;
        store_elements(values.elements<T>() + vat, v.data_ptr<float>() + (r * kv_heads + h) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

// ---- profiling ------------------------------------------------------------------------------

std::vector<std::string> LayerProfile::part_names() {
  return {"input_norm", "qkv", "attention", "store_kv", "o_proj", "post_norm", "mlp_gate_up", "mlp_activation",
          "mlp_down", "experts", "final_norm", "all_reduce"};
}

double LayerProfile::now() const {
  if (thread_clock) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

// Charges the time since the last lap to a part; does nothing without a profile.
class Laps {
 public:
  explicit Laps(LayerProfile* profile) : profile_(profile), last_(profile != nullptr ? profile->now() : 0.0) {}
  void lap(LayerProfile::Part part) {
    if (profile_ == nullptr) return;
    const double now = profile_->now();
    profile_->seconds[part] += now - last_;
    last_ = now;
  }

 private:
  LayerProfile* profile_;
  double last_;
};

}  // namespace

namespace {

// A layer in two parts, each ending where a tensor-parallel rank all-reduces its partial sums:
//
//   attention_part: x = norm(h); q|k|v; rope; attend (+ sinks); store K/V; o = attended @ W_o.T (+ b)
//   mlp_part:       x = post_norm(h'); the gated MLP or the experts (+ b)      h' = h + sum of o
//
// One rank adds each part to the stream itself (decode_layer); a rank of several returns the
// partial o and MLP output to the caller, which sums them over the ranks before adding.

// The attention part: (o, plus h with add_residual; the rows' new K and V, stored in their slots).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_part(
    const at::Tensor& h_in, at::TensorList norms, const std::optional<at::Tensor>& qk_norm, at::TensorList weights,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& key_start, const at::Tensor& key_end, const at::Tensor& write_blocks,
    const at::Tensor& write_offsets, at::IntArrayRef geometry, double eps, double scale,
    const std::optional<at::Tensor>& sinks, bool add_residual, Laps& laps, int64_t batch_digits) {
  TORCH_CHECK(norms.size() == 2 && (weights.size() == 4 || weights.size() == 8) && formats.size() == 4 &&
                  biases.size() == 4,
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
  const at::Tensor input_norm = norms[0].contiguous();

  at::Tensor x = at::empty({rows, hidden}, h.options());
  rms_norm_rows(h.data_ptr<float>(), input_norm.data_ptr<float>(), rows, hidden, hidden, epsf, x.data_ptr<float>(),
                hidden);
  laps.lap(LayerProfile::kInputNorm);
  at::Tensor qkv = weight_linear(x, weights[0], formats[0], biases.get(0), batch_digits, row_tiles_of(weights, 0));
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
  laps.lap(LayerProfile::kQkv);
  const at::Tensor attended =
      paged_decode_attention(q, k_cache, v_cache, block_table, key_start, key_end, k, v, scale, sinks).view({rows, q_width});
  laps.lap(LayerProfile::kAttention);
  store_new_kv(k, v, k_cache, v_cache, write_blocks, write_offsets);
  laps.lap(LayerProfile::kStoreKv);
  at::Tensor out = weight_linear(attended, weights[1], formats[1], biases.get(1), batch_digits,
                                 row_tiles_of(weights, 1));
  TORCH_CHECK(out.size(1) == hidden, "llama_decode_layer: o weight does not give the hidden size");
  if (add_residual) out.add_(h);  // the residual stream after attention
  laps.lap(LayerProfile::kOProj);
  return {out, k, v};
}

// The MLP part over h (the stream after attention): the MLP's output, not yet added to h.
at::Tensor mlp_part(const at::Tensor& h_in, at::TensorList norms, at::TensorList weights, at::IntArrayRef formats,
                    const c10::List<std::optional<at::Tensor>>& biases, double eps, SparseMoeMlp* moe, Laps& laps,
                    int64_t batch_digits) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat && norms.size() == 2 &&
                  norms[1].scalar_type() == at::kFloat && norms[1].numel() == h_in.size(1),
              "llama_decode_layer: h must be float32 [rows, hidden] and the post norm [hidden]");
  const at::Tensor h = h_in.contiguous(), post_norm = norms[1].contiguous();
  const int64_t rows = h.size(0), hidden = h.size(1);
  at::Tensor x = at::empty({rows, hidden}, h.options());
  rms_norm_rows(h.data_ptr<float>(), post_norm.data_ptr<float>(), rows, hidden, hidden, static_cast<float>(eps),
                x.data_ptr<float>(), hidden);
  laps.lap(LayerProfile::kPostNorm);
  if (moe != nullptr) {
    at::Tensor experts = moe->forward(x);
    laps.lap(LayerProfile::kExperts);
    return experts;
  }
  at::Tensor gate_up = weight_linear(x, weights[2], formats[2], biases.get(2), batch_digits, row_tiles_of(weights, 2));
  laps.lap(LayerProfile::kMlpGateUp);
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
  laps.lap(LayerProfile::kMlpActivation);
  at::Tensor mlp = weight_linear(act, weights[3], formats[3], biases.get(3), batch_digits, row_tiles_of(weights, 3));
  TORCH_CHECK(mlp.size(1) == hidden, "llama_decode_layer: down weight does not give the hidden size");
  laps.lap(LayerProfile::kMlpDown);
  return mlp;
}

// llama_decode_layer with, optionally, attention sinks (gpt-oss) and a mixture of experts in place
// of the gated MLP (whose weights, formats and biases are then unused): both parts, each added.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& h, at::TensorList norms, const std::optional<at::Tensor>& qk_norm, at::TensorList weights,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& key_start, const at::Tensor& key_end, const at::Tensor& write_blocks,
    const at::Tensor& write_offsets, at::IntArrayRef geometry, double eps, double scale,
    const std::optional<at::Tensor>& sinks, SparseMoeMlp* moe, LayerProfile* profile,
    int64_t batch_digits = kOneRowDigits) {
  Laps laps(profile);
  auto [out, k, v] = attention_part(h, norms, qk_norm, weights, formats, biases, cos, sin, k_cache, v_cache, block_table,
                                    key_start, key_end, write_blocks, write_offsets, geometry, eps, scale, sinks,
                                    /*add_residual=*/true, laps, batch_digits);
  out.add_(mlp_part(out, norms, weights, formats, biases, eps, moe, laps, batch_digits));
  laps.lap(moe != nullptr ? LayerProfile::kExperts : LayerProfile::kMlpDown);  // the add, with its part
  return {out, k, v};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> llama_decode_layer(
    const at::Tensor& h_in, at::TensorList norms, const std::optional<at::Tensor>& qk_norm, at::TensorList weights,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& key_start, const at::Tensor& key_end, const at::Tensor& write_blocks,
    const at::Tensor& write_offsets, at::IntArrayRef geometry, double eps, double scale) {
  return decode_layer(h_in, norms, qk_norm, weights, formats, biases, cos, sin, k_cache, v_cache, block_table,
                      key_start, key_end, write_blocks, write_offsets, geometry, eps, scale, std::nullopt, nullptr,
                      nullptr);
}

// ---- every decoder layer of a model in one call (LlamaDecoderStack: fused_layer.h) ---------

void LlamaDecoderStack::add_layer(std::vector<at::Tensor> norms, std::optional<at::Tensor> qk_norm,
                                  std::vector<at::Tensor> weights, std::vector<int64_t> formats,
                                  std::vector<at::Tensor> biases, std::vector<int64_t> geometry, double eps,
                                  double scale, at::Tensor k_cache, at::Tensor v_cache, int64_t group) {
  TORCH_CHECK(biases.size() == 4, "LlamaDecoderStack.add_layer: four biases (empty for none)");
  Layer layer{std::move(norms), std::move(weights), std::move(qk_norm), std::move(formats), std::move(geometry),
              c10::List<std::optional<at::Tensor>>(), std::move(k_cache), std::move(v_cache), group, eps, scale};
  for (const at::Tensor& bias : biases) {
    layer.biases.push_back(bias.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(bias));
  }
  if (one_row_tiles && q4_1_row_tiles_supported() && layer.weights.size() == 4 && layer.formats.size() == 4) {
    for (size_t i = 0; i < 4; ++i) {
      const at::Tensor& weight = layer.weights[i];
      const bool tiled = layer.formats[i] == kQ41Weight && weight.dim() == 2 && weight.size(0) % 16 == 0;
      layer.weights.push_back(tiled ? q4_1_row_tiles(weight) : at::Tensor());
    }
  }
  layers.push_back(std::move(layer));
}

void LlamaDecoderStack::attach_sinks(at::Tensor sinks) {
  TORCH_CHECK(!layers.empty(), "LlamaDecoderStack.attach_sinks: no layer yet");
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == layers.back().geometry[0],
              "LlamaDecoderStack.attach_sinks: one float32 sink logit per query head");
  layers.back().sinks = sinks.contiguous();
}

void LlamaDecoderStack::attach_moe(c10::intrusive_ptr<SparseMoeMlp> moe) {
  TORCH_CHECK(!layers.empty(), "LlamaDecoderStack.attach_moe: no layer yet");
  TORCH_CHECK(moe->router_weight.numel() > 0, "LlamaDecoderStack.attach_moe: the experts need their router");
  layers.back().moe = std::move(moe);
}

at::Tensor LlamaDecoderStack::forward(at::Tensor h, at::Tensor cos, at::Tensor sin,
                                      std::vector<at::Tensor> block_tables, std::vector<at::Tensor> key_starts,
                                      std::vector<at::Tensor> key_ends, std::vector<at::Tensor> write_blocks,
                                      at::Tensor write_offsets) {
  for (const Layer& layer : layers) {
    const size_t g = static_cast<size_t>(layer.group);
    TORCH_CHECK(g < block_tables.size() && g < key_starts.size() && g < key_ends.size() && g < write_blocks.size(),
                "LlamaDecoderStack.forward: no rows for KV group ", layer.group);
    h = std::get<0>(decode_layer(h, layer.norms, layer.qk_norm, layer.weights, layer.formats, layer.biases, cos,
                                 sin, layer.k_cache, layer.v_cache, block_tables[g], key_starts[g], key_ends[g],
                                 write_blocks[g], write_offsets, layer.geometry, layer.eps, layer.scale, layer.sinks,
                                 layer.moe.get(), profile.has_value() ? &*profile : nullptr, batch_digits));
  }
  if (!final_norm.defined()) return h;
  Laps laps(profile.has_value() ? &*profile : nullptr);
  const at::Tensor hc = h.contiguous();
  at::Tensor normed = at::empty(hc.sizes(), hc.options());
  const int64_t rows = hc.size(0), hidden = hc.size(1);
  TORCH_CHECK(final_norm.numel() == hidden, "LlamaDecoderStack.forward: the final norm does not fit the hidden size");
  rms_norm_rows(hc.data_ptr<float>(), final_norm.data_ptr<float>(), rows, hidden, hidden,
                static_cast<float>(final_norm_eps), normed.data_ptr<float>(), hidden);
  laps.lap(LayerProfile::kFinalNorm);
  return normed;
}

const LlamaDecoderStack::Layer& LlamaDecoderStack::layer_at(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers.size()), "LlamaDecoderStack: no layer ", index);
  return layers[static_cast<size_t>(index)];
}

at::Tensor LlamaDecoderStack::attention_partial(int64_t index, at::Tensor h, at::Tensor cos, at::Tensor sin,
                                                std::vector<at::Tensor> block_tables,
                                                std::vector<at::Tensor> key_starts, std::vector<at::Tensor> key_ends,
                                                std::vector<at::Tensor> write_blocks, at::Tensor write_offsets) {
  const Layer& layer = layer_at(index);
  const size_t g = static_cast<size_t>(layer.group);
  TORCH_CHECK(g < block_tables.size() && g < key_starts.size() && g < key_ends.size() && g < write_blocks.size(),
              "LlamaDecoderStack.attention_partial: no rows for KV group ", layer.group);
  Laps laps(profile.has_value() ? &*profile : nullptr);
  return std::get<0>(attention_part(h, layer.norms, layer.qk_norm, layer.weights, layer.formats, layer.biases, cos, sin,
                                    layer.k_cache, layer.v_cache, block_tables[g], key_starts[g], key_ends[g],
                                    write_blocks[g], write_offsets, layer.geometry, layer.eps, layer.scale, layer.sinks,
                                    /*add_residual=*/false, laps, batch_digits));
}

at::Tensor LlamaDecoderStack::mlp_partial(int64_t index, at::Tensor h) {
  const Layer& layer = layer_at(index);
  Laps laps(profile.has_value() ? &*profile : nullptr);
  return mlp_part(h, layer.norms, layer.weights, layer.formats, layer.biases, layer.eps, layer.moe.get(), laps,
                  batch_digits);
}

std::tuple<at::Tensor, int64_t> LlamaDecoderStack::forward_ranked(
    at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> block_tables,
    std::vector<at::Tensor> key_starts, std::vector<at::Tensor> key_ends, std::vector<at::Tensor> write_blocks,
    at::Tensor write_offsets, c10::intrusive_ptr<HostExchange> exchange, int64_t sequence) {
  TORCH_CHECK(exchange, "LlamaDecoderStack.forward_ranked: no exchange");
  Laps laps(profile.has_value() ? &*profile : nullptr);
  for (const Layer& layer : layers) {
    const size_t g = static_cast<size_t>(layer.group);
    TORCH_CHECK(g < block_tables.size() && g < key_starts.size() && g < key_ends.size() && g < write_blocks.size(),
                "LlamaDecoderStack.forward_ranked: no rows for KV group ", layer.group);
    at::Tensor partial = std::get<0>(attention_part(
        h, layer.norms, layer.qk_norm, layer.weights, layer.formats, layer.biases, cos, sin, layer.k_cache,
        layer.v_cache, block_tables[g], key_starts[g], key_ends[g], write_blocks[g], write_offsets, layer.geometry,
        layer.eps, layer.scale, layer.sinks, /*add_residual=*/false, laps, batch_digits)).contiguous();
    sequence = exchange->all_reduce(partial, sequence);
    h = h.add(partial);
    laps.lap(LayerProfile::kAllReduce);
    partial = mlp_part(h, layer.norms, layer.weights, layer.formats, layer.biases, layer.eps, layer.moe.get(), laps,
                       batch_digits).contiguous();
    sequence = exchange->all_reduce(partial, sequence);
    h = h.add(partial);
    laps.lap(LayerProfile::kAllReduce);
  }
  return {h, sequence};
}

void LlamaDecoderStack::set_final_norm(at::Tensor weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1,
              "LlamaDecoderStack.set_final_norm: a float32 weight [hidden]");
  final_norm = weight.contiguous();
  final_norm_eps = eps;
}

void LlamaDecoderStack::set_batch_activation_digits(int64_t digits) {
  TORCH_CHECK(digits >= 1 && digits <= kOneRowDigits, "LlamaDecoderStack.set_batch_activation_digits: 1, 2 or 3, not ",
              digits);
  batch_digits = digits;
}

void LlamaDecoderStack::set_one_row_tiles(bool enabled) {
  TORCH_CHECK(layers.empty(), "LlamaDecoderStack.set_one_row_tiles: before the first layer");
  one_row_tiles = enabled;
}

int64_t LlamaDecoderStack::one_row_tile_bytes() const {
  int64_t total = 0;
  for (const Layer& layer : layers) {
    for (size_t i = 4; i < layer.weights.size(); ++i) {
      if (layer.weights[i].defined()) total += layer.weights[i].nbytes();
    }
  }
  return total;
}

void LlamaDecoderStack::start_profile(bool thread_clock) {
  profile.emplace();
  profile->thread_clock = thread_clock;
}

void LlamaDecoderStack::stop_profile() { profile.reset(); }

std::vector<double> LlamaDecoderStack::profile_seconds() const {
  TORCH_CHECK(profile.has_value(), "LlamaDecoderStack.profile_seconds: profiling was not started");
  return std::vector<double>(profile->seconds.begin(), profile->seconds.end());
}

}  // namespace pdserve::kernels
