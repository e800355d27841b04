// The fused decoder layer's entry points, for fused_layer.cpp that defines them and
// registration.cpp that registers them. Invariant: a stack holds only what is fixed from
// start-up (weights, norms, geometry, page views); everything per step is an argument.

#pragma once

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <string>
#include <tuple>

#include "host_exchange.h"
#include "moe_experts.h"

namespace pdserve::kernels {

// One decoder layer of the Llama family for single-token rows (fused_layer.cpp): the residual
// stream after the layer, and the rows' new K and V (also stored in their page slots).
std::tuple<at::Tensor, at::Tensor, at::Tensor> llama_decode_layer(
    const at::Tensor& h_in, at::TensorList norms, const std::optional<at::Tensor>& qk_norm, at::TensorList weights,
    at::IntArrayRef formats, const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& key_start, const at::Tensor& key_end, const at::Tensor& write_blocks,
    const at::Tensor& write_offsets, at::IntArrayRef geometry, double eps, double scale);

// ---- where a decode step's layer time goes ----------------------------------------------------
//
// Seconds spent in each part of the decoder layers, summed over layers and calls since it was
// started (bench/kernels/decode.py). Each part ends where the next begins, so the parts add up to
// the layers' whole time; the clock is the wall (steady) or the calling thread's CPU time.
struct LayerProfile {
  enum Part { kInputNorm, kQkv, kAttention, kStoreKv, kOProj, kPostNorm, kMlpGateUp, kMlpActivation, kMlpDown,
              kExperts, kFinalNorm, kAllReduce, kNumParts };
  static std::vector<std::string> part_names();
  bool thread_clock = false;
  std::array<double, kNumParts> seconds{};
  double now() const;
};

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
    std::optional<at::Tensor> sinks;  // gpt-oss: one logit per query head
    c10::intrusive_ptr<SparseMoeMlp> moe;  // set: the experts replace the gated MLP
  };
  std::vector<Layer> layers;
  const Layer& layer_at(int64_t index) const;  // a checked index

  // biases: an empty tensor stands for none (a method argument cannot be a list of optionals).
  void add_layer(std::vector<at::Tensor> norms, std::optional<at::Tensor> qk_norm, std::vector<at::Tensor> weights,
                 std::vector<int64_t> formats, std::vector<at::Tensor> biases, std::vector<int64_t> geometry,
                 double eps, double scale, at::Tensor k_cache, at::Tensor v_cache, int64_t group);

  // The last added layer's attention sinks, or its mixture of experts (in place of its gated
  // MLP, whose weights add_layer then ignores).
  void attach_sinks(at::Tensor sinks);
  void attach_moe(c10::intrusive_ptr<SparseMoeMlp> moe);

  // A tensor-parallel rank's layer `index` in its two parts (fused_layer.cpp's attention_part and
  // mlp_part), each returned before the all-reduce the caller runs: the partial output projection
  // (the rows' new K/V stored), then, over h plus the summed projection, the partial MLP output.
  // Per-step arguments as forward's; no final norm (the caller's).
  at::Tensor attention_partial(int64_t index, at::Tensor h, at::Tensor cos, at::Tensor sin,
                               std::vector<at::Tensor> block_tables, std::vector<at::Tensor> key_starts,
                               std::vector<at::Tensor> key_ends, std::vector<at::Tensor> write_blocks,
                               at::Tensor write_offsets);
  at::Tensor mlp_partial(int64_t index, at::Tensor h);

  // A tensor-parallel rank's whole stack in one call, each partial summed over the ranks through
  // `exchange` (exchanges sequence + 1, ...) and added to the stream as the caller of the two parts
  // above does (h + sum, the same bits): the stream after every layer (no final norm) and the last
  // exchange used. Per-step arguments as forward's.
  std::tuple<at::Tensor, int64_t> forward_ranked(at::Tensor h, at::Tensor cos, at::Tensor sin,
                                                 std::vector<at::Tensor> block_tables,
                                                 std::vector<at::Tensor> key_starts, std::vector<at::Tensor> key_ends,
                                                 std::vector<at::Tensor> write_blocks, at::Tensor write_offsets,
                                                 c10::intrusive_ptr<HostExchange> exchange, int64_t sequence);

  // The model's final RMSNorm (float32 weight [hidden]), applied after the last layer: forward
  // then returns the normed stream (a step spent ~0.17 ms in the six torch ops it replaces).
  void set_final_norm(at::Tensor weight, double eps);
  at::Tensor final_norm;
  double final_norm_eps = 0;

  // Activation digits of the Q4_1 products of batched steps (q4_1_batch_linear): 3, the one-row
  // kernel's 22 bits, unless set to 2 (15 bits) or 1 (8 bits): faster, and a row's greedy tokens may
  // then depend on its batch.
  void set_batch_activation_digits(int64_t digits);
  int64_t batch_activation_digits() const { return batch_digits; }
  int64_t batch_digits = kOneRowDigits;

  // One-row tiles (q4_1_row_tiles.cpp): where the CPU has AVX-512 VNNI, add_layer rearranges each
  // Q4_1 weight of 16k rows into a copy that steps of 1-2 rows multiply with (each row to its
  // batch-1 bits), ~1.1x faster at one row, for as many bytes again as those weights (one_row_tile_bytes).
  // On unless set off before the first layer.
  void set_one_row_tiles(bool enabled);
  bool one_row_tiles = true;
  int64_t one_row_tile_bytes() const;

  // Profiling (off until started; a null check per part when off): start_profile resets the
  // sums and picks the clock, profile_seconds reads them in profile_parts' order.
  void start_profile(bool thread_clock);
  void stop_profile();
  std::vector<double> profile_seconds() const;
  std::vector<std::string> profile_parts() const { return LayerProfile::part_names(); }
  std::optional<LayerProfile> profile;

  // The residual stream after every layer (normed, with a final norm set); each layer's new K/V
  // stored in its slot. Per KV group
  // g: block_tables[g], key_starts[g], key_ends[g], write_blocks[g]; write_offsets for all.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> key_starts, std::vector<at::Tensor> key_ends,
                     std::vector<at::Tensor> write_blocks, at::Tensor write_offsets);
};

}  // namespace pdserve::kernels
