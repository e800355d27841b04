// The pdserve_cpu op library: each op's schema and its CPU implementation, and the decoder
// stack class. Invariant: each schema matches the C++ function it binds (kernels.h,
// fused_layer.h) and what Python passes, native.py's fake (shape) functions included.

#include <torch/custom_class.h>
#include <torch/library.h>

#include "fused_layer.h"

namespace pdserve::kernels {

TORCH_LIBRARY(pdserve_cpu, m) {
  m.class_<SparseMoeMlp>("SparseMoeMlp")
      .def(torch::init<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, at::Tensor,
                       at::Tensor, std::vector<int64_t>, std::vector<double>>())
      .def("route", &SparseMoeMlp::route)
      .def("run_experts", &SparseMoeMlp::run_experts)
      .def("forward", &SparseMoeMlp::forward);
  m.class_<HostExchange>("HostExchange")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>,
                       std::vector<int64_t>, double, double, double, bool>())
      .def("all_reduce", &HostExchange::all_reduce)
      .def("forget", &HostExchange::forget);  // before the stack, whose forward_ranked takes one
  m.class_<LlamaDecoderStack>("LlamaDecoderStack")
      .def(torch::init<>())
      .def("add_layer", &LlamaDecoderStack::add_layer)
      .def("attach_sinks", &LlamaDecoderStack::attach_sinks)
      .def("attach_moe", &LlamaDecoderStack::attach_moe)
      .def("attention_partial", &LlamaDecoderStack::attention_partial)
      .def("mlp_partial", &LlamaDecoderStack::mlp_partial)
      .def("set_final_norm", &LlamaDecoderStack::set_final_norm)
      .def("set_batch_activation_digits", &LlamaDecoderStack::set_batch_activation_digits)
      .def("batch_activation_digits", &LlamaDecoderStack::batch_activation_digits)
      .def("set_one_row_tiles", &LlamaDecoderStack::set_one_row_tiles)
      .def("one_row_tile_bytes", &LlamaDecoderStack::one_row_tile_bytes)
      .def("start_profile", &LlamaDecoderStack::start_profile)
      .def("stop_profile", &LlamaDecoderStack::stop_profile)
      .def("profile_seconds", &LlamaDecoderStack::profile_seconds)
      .def("profile_parts", &LlamaDecoderStack::profile_parts)
      .def("forward_ranked", &LlamaDecoderStack::forward_ranked)
      .def("forward", &LlamaDecoderStack::forward);
  m.def("q4_1_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("q4_1_linear_with(Tensor x, Tensor blocks, int lanes, int digits) -> Tensor");
  m.def("q4_1_row_tiles_supported() -> bool", &q4_1_row_tiles_supported);
  m.def("q4_1_row_tiles(Tensor blocks) -> Tensor");
  m.def("q4_1_tiled_linear(Tensor x, Tensor tiles) -> Tensor");
  m.def("f32_row_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("dequantize_blocks(Tensor blocks, int block_bytes) -> Tensor");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor key_start, "
      "Tensor key_end, Tensor? k_new, Tensor? v_new, float scale, Tensor? sinks=None) -> Tensor");
  m.def(
      "llama_decode_layer(Tensor h, Tensor[] norms, Tensor? qk_norm, Tensor[] weights, int[] formats, "
      "Tensor?[] biases, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, "
      "Tensor key_start, Tensor key_end, Tensor write_blocks, Tensor write_offsets, int[] geometry, float eps, "
      "float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q4_1_linear_with", &q4_1_linear_with);
  m.impl("q4_1_row_tiles", &q4_1_row_tiles);
  m.impl("q4_1_tiled_linear", &q4_1_tiled_linear);
  m.impl("f32_row_linear", &f32_row_linear);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("greedy_tokens", &greedy_tokens);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("llama_decode_layer", &llama_decode_layer);
}

}  // namespace pdserve::kernels
