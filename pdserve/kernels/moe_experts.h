// The mixture-of-experts MLP as one native object (moe_experts.cpp): routing, grouping by expert
// and every active expert's gate|up and down. Invariant: it computes what pdserve.models.moe's
// torch path computes, up to float rounding order: each token's output is the sum over its k
// experts, in ascending expert order, of weight * expert(token).

#pragma once

#include <torch/custom_class.h>

#include "kernels.h"

namespace pdserve::kernels {

// An MXFP4 weight row is k / 32 groups, each one E8M0 scale byte then 16 bytes of E2M1 codes.
constexpr int64_t kMxfp4GroupValues = 32, kMxfp4GroupBytes = 17;

struct SparseMoeMlp : torch::CustomClassHolder {
  // How router logits become (weights, expert ids); pdserve.models.moe's routing rules.
  static constexpr int64_t kTopKThenSoftmax = 0;            // gpt-oss
  static constexpr int64_t kSoftmaxThenTopK = 1;            // Qwen3-MoE, norm_topk_prob false
  static constexpr int64_t kSoftmaxThenTopKRenormalized = 2;  // Qwen3-MoE, norm_topk_prob true
  // The gated activation over each expert's (gate, up) halves.
  static constexpr int64_t kSiluAndMul = 0;     // silu(gate) * up
  static constexpr int64_t kClampedSwiglu = 1;  // gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
  // The experts' weight formats (0-2 as kernels/fused_layer.cpp numbers them).
  static constexpr int64_t kFloat32 = 0, kQ4_1 = 1, kQ8_0 = 2, kMxfp4 = 3, kBfloat16 = 4;

  at::Tensor router_weight;  // float32 [experts, hidden]; empty: no router (run_experts only)
  std::optional<at::Tensor> router_bias;  // [experts]
  std::vector<at::Tensor> gate_up, down;  // per expert: [2I, hidden] gate rows then up rows; [hidden, I]
  int64_t format = kFloat32;  // every expert's weights: float32, Q4_1 or Q8_0 blocks, MXFP4 or bfloat16 rows
  int64_t expert_width = 0;   // I (row formats; the block path reads it off each product)
  std::optional<at::Tensor> gate_up_bias, down_bias;  // [experts, 2I], [experts, hidden]
  int64_t top_k = 1, routing = kTopKThenSoftmax, activation = kSiluAndMul;
  float alpha = 0.f, limit = 0.f;

  // Empty tensors stand for none (a custom class argument cannot be an optional list member).
  // routing: (top_k, rule); activation: (kind, alpha, limit).
  SparseMoeMlp(at::Tensor router_weight, at::Tensor router_bias, std::vector<at::Tensor> gate_up,
               std::vector<at::Tensor> down, int64_t format, at::Tensor gate_up_bias, at::Tensor down_bias,
               std::vector<int64_t> routing, std::vector<double> activation);

  // x [n, hidden] -> (weights float32 [n, k], expert ids int64 [n, k]), each row's k in descending weight.
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x);
  // x [n, hidden], each token's (weights, ids) [n, k] -> [n, hidden].
  at::Tensor run_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids);
  at::Tensor forward(const at::Tensor& x);
  // float32, bfloat16 and MXFP4 experts run in the few-row kernel; Q4_1/Q8_0 in the block kernels.
  bool reads_rows() const { return format == kFloat32 || format == kMxfp4 || format == kBfloat16; }
};

}  // namespace pdserve::kernels
