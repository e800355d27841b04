"""Tiny random gpt-oss (attention sinks, sliding windows shorter than the prompt alternating with full
layers, YaRN, 6 experts top-2 with biases and the clamped SwiGLU) and Qwen3-MoE (one dense layer via
`mlp_only_layers`, renormalised top-2 of 6) saved by transformers and loaded by our loader: logits and
greedy tokens against transformers in float32, with guards that the sinks and windows matter."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from pdserve.models.layers import GatedMLP
from pdserve.models.loader import load_model
from pdserve.models.moe import SparseMoE
from pdserve.models.quant.modules import QuantizedLinear
from pdserve.models.registry import TensorParallelRank, build_model
from pdserve.models.weights import SafetensorsSource
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits
from tests.tiny_models import (
    GPT_OSS_LAYER_TYPES, GPT_OSS_VOCAB, GPT_OSS_WINDOW, QWEN_MOE_DENSE_LAYERS, QWEN_MOE_VOCAB, make_tiny_gpt_oss,
    make_tiny_qwen3_moe, random_prompt,
)

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gpt_oss"))
    hf_model = make_tiny_gpt_oss(directory)
    return hf_model, load_model(directory, torch.float32, CPU), directory


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_moe"))
    hf_model = make_tiny_qwen3_moe(directory)
    return hf_model, load_model(directory, torch.float32, CPU), directory


def _prompt_logits(model, prompt):
    return forward_chunk(model, ContiguousAttention(model.spec.layer_specs), "s", prompt)


def test_gpt_oss_layers_alternate_windows_and_carry_sinks(gpt_oss):
    _, ours, _ = gpt_oss
    expected = tuple(SlidingWindowSpec(GPT_OSS_WINDOW) if t == "sliding_attention" else FullAttentionSpec()
                     for t in GPT_OSS_LAYER_TYPES)
    assert ours.model.spec.layer_specs == expected
    assert all(layer.attention_sinks.shape == (4,) for layer in ours.model.layers)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen_moe"])
def test_prompt_longer_than_the_window_gives_transformers_logits(family, request):
    hf_model, ours, _ = request.getfixturevalue(family)
    vocab = GPT_OSS_VOCAB if family == "gpt_oss" else QWEN_MOE_VOCAB
    prompt = random_prompt(60, vocab, 1)
    torch.testing.assert_close(_prompt_logits(ours.model, prompt), hf_prompt_logits(hf_model, prompt),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen_moe"])
@pytest.mark.parametrize("chunk_tokens", [None, 13])
def test_greedy_decoding_matches_transformers(family, chunk_tokens, request):
    hf_model, ours, _ = request.getfixturevalue(family)
    vocab = GPT_OSS_VOCAB if family == "gpt_oss" else QWEN_MOE_VOCAB
    prompt = random_prompt(50, vocab, 3)
    assert greedy_generate(ours.model, prompt, 24, chunk_tokens=chunk_tokens) == hf_greedy_generate(hf_model, prompt, 24)


def test_dropping_the_sinks_or_the_window_would_change_the_logits(gpt_oss):
    """Guards the parity tests: both features matter for these weights and this prompt."""
    hf_model, ours, _ = gpt_oss
    prompt = random_prompt(60, GPT_OSS_VOCAB, 1)
    expected = hf_prompt_logits(hf_model, prompt)
    all_full = forward_chunk(ours.model, ContiguousAttention((FullAttentionSpec(),) * 4), "s", prompt)
    assert (all_full - expected).abs().max() > 1e-2
    saved = [layer.attention_sinks for layer in ours.model.layers]
    try:
        for layer in ours.model.layers:
            layer.attention_sinks = None
        assert (_prompt_logits(ours.model, prompt) - expected).abs().max() > 1e-2
    finally:
        for layer, sinks in zip(ours.model.layers, saved):
            layer.attention_sinks = sinks


def test_qwen3_moe_dense_layers_follow_mlp_only_layers(qwen_moe):
    _, ours, _ = qwen_moe
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert kinds == [GatedMLP if i in QWEN_MOE_DENSE_LAYERS else SparseMoE for i in range(4)]
    assert ours.model.spec.architecture == "qwen3_moe"


def _fuse_qwen_experts(source_dir: str, target_dir: str) -> None:
    """The fused layout transformers 5 keeps in memory: experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    tensors = load_file(os.path.join(source_dir, "model.safetensors"))
    fused = {}
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts."
        names = sorted({k for k in tensors if k.startswith(prefix)})
        if not names:
            continue
        count = len({k[len(prefix):].split(".")[0] for k in names})
        gate_up = [torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]])
                   for e in range(count)]
        fused[prefix + "gate_up_proj"] = torch.stack(gate_up)
        fused[prefix + "down_proj"] = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(count)])
        for name in names:
            del tensors[name]
    save_file({**tensors, **fused}, os.path.join(target_dir, "model.safetensors"))
    for name in os.listdir(source_dir):
        if not name.endswith(".safetensors"):
            with open(os.path.join(source_dir, name), "rb") as src, open(os.path.join(target_dir, name), "wb") as dst:
                dst.write(src.read())


def test_qwen3_moe_fused_expert_layout_loads_the_same_model(qwen_moe, tmp_path):
    hf_model, _, directory = qwen_moe
    _fuse_qwen_experts(directory, str(tmp_path))
    with SafetensorsSource(str(tmp_path)) as source:
        assert source.has("model.layers.0.mlp.experts.gate_up_proj")
        assert not source.has("model.layers.0.mlp.experts.0.gate_proj.weight")
    fused = load_model(str(tmp_path), torch.float32, CPU)
    prompt = random_prompt(40, QWEN_MOE_VOCAB, 5)
    torch.testing.assert_close(_prompt_logits(fused.model, prompt), hf_prompt_logits(hf_model, prompt),
                               atol=1e-4, rtol=1e-4)


def test_experts_run_one_matmul_per_active_expert_not_per_token(gpt_oss):
    _, ours, _ = gpt_oss
    moe = ours.model.layers[0].mlp
    calls: list[int] = []
    hooks = [linear.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
             for linear in moe.experts.gate_up]
    moe.experts.native_enabled = False  # the torch path's modules (the native one: test_moe_native.py)
    try:
        x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            _, ids = moe.route(torch.nn.functional.linear(x, moe.router_weight, moe.router_bias))
            moe(x)
    finally:
        moe.experts.native_enabled = True
        for hook in hooks:
            hook.remove()
    active = ids.unique().numel()
    assert len(calls) == active  # one gate|up matmul per expert that any token chose
    assert sum(calls) == 37 * 2  # over exactly the (token, expert) pairs


def test_int8_experts_use_the_quantized_weight_path(gpt_oss):
    hf_model, _, directory = gpt_oss
    quantized = load_model(directory, torch.float32, CPU, quantization="int8")
    experts = quantized.model.layers[0].mlp.experts
    assert all(isinstance(m, QuantizedLinear) for m in [*experts.gate_up, *experts.down])
    prompt = random_prompt(40, GPT_OSS_VOCAB, 2)
    ours, expected = _prompt_logits(quantized.model, prompt), hf_prompt_logits(hf_model, prompt)
    agreement = (ours.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement


def test_tensor_parallel_rank_keeps_its_heads_sinks_and_a_slice_of_every_expert(gpt_oss):
    """TP > 1 loads (it was refused before issue 23, part 5): rank 1 of 2 holds query heads 2-3 with
    their sinks and half of every expert; tests/models/test_moe_tensor_parallel.py checks the sums."""
    _, ours, directory = gpt_oss
    config = json.load(open(os.path.join(directory, "config.json")))
    rank = TensorParallelRank(1, 2, lambda t: t, lambda t: t)
    with SafetensorsSource(directory) as source:
        shard = build_model(config, source, torch.float32, CPU, parallel=rank)
    whole_layer, layer = ours.model.layers[0], shard.layers[0]
    assert shard.spec.num_heads == 2 and shard.spec.tensor_parallel_size == 2
    assert torch.equal(layer.attention_sinks, whole_layer.attention_sinks[2:])
    experts = layer.mlp.experts.inner
    assert experts.intermediate_size == 16 and experts.num_experts == 6
    assert not any(down.bias.any() for down in experts.down)  # rank 0 alone adds down's bias
