"""Experts a checkpoint holds in bfloat16, in a float32 model on the CPU: kept bfloat16
(`Bfloat16Linear`, half float32's bytes) and run by the native experts, which widen them exactly,
so the model's logits equal those of the same model with float32 experts bit for bit; a policy
that quantizes takes them as before. The kernel's own bits: tests/models/test_moe_native.py."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models.loader import load_model
from pdserve.models.quant.modules import Bfloat16Linear, QuantizedLinear
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.test_mxfp4 import _with_float_experts
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import QWEN_MOE_VOCAB, make_tiny_qwen3_moe, random_prompt

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE whose expert tensors are stored in bfloat16 (as released MoE checkpoints are)."""
    directory = str(tmp_path_factory.mktemp("qwen3_moe_bf16"))
    make_tiny_qwen3_moe(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    num_experts = 0
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name] = tensors[name].to(torch.bfloat16)
        num_experts += 1
    assert num_experts > 0
    save_file(tensors, path)
    return directory


def _sparse_experts(model) -> list:
    return [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]


def test_bfloat16_experts_stay_bfloat16_and_give_the_float_experts_logits_bit_for_bit(bfloat16_checkpoint):
    require_native_kernels()
    model = load_model(bfloat16_checkpoint, torch.float32, CPU).model
    experts = _sparse_experts(model)
    assert experts and all(isinstance(layer, Bfloat16Linear) for e in experts for layer in [*e.gate_up, *e.down])
    prompt = random_prompt(40, QWEN_MOE_VOCAB, 3)
    kept = forward_chunk(model, ContiguousAttention(model.spec.layer_specs), "s", prompt)
    assert all(e.native_object(torch.zeros(1, 1)) is not None for e in experts)  # they ran natively
    twin = _with_float_experts(load_model(bfloat16_checkpoint, torch.float32, CPU).model)
    assert all(isinstance(e.down[0], torch.nn.Linear) for e in _sparse_experts(twin))
    assert torch.equal(kept, forward_chunk(twin, ContiguousAttention(twin.spec.layer_specs), "s", prompt))


def test_experts_the_native_kernel_cannot_run_are_widened_at_load(bfloat16_checkpoint, monkeypatch):
    """An activation the kernel does not know keeps the torch path, which would widen bfloat16 rows
    on every call: those experts are widened once, at load."""
    require_native_kernels()
    from pdserve.models import qwen3_moe

    monkeypatch.setattr(qwen3_moe, "silu_and_mul", lambda gate, up: torch.nn.functional.silu(gate) * up)
    model = load_model(bfloat16_checkpoint, torch.float32, CPU).model
    experts = _sparse_experts(model)
    assert experts and all(not isinstance(layer, Bfloat16Linear) and layer.weight.dtype == torch.float32
                           for e in experts for layer in e.gate_up)


def test_a_quantizing_policy_quantizes_bfloat16_experts_as_before(bfloat16_checkpoint):
    require_native_kernels()
    model = load_model(bfloat16_checkpoint, torch.float32, CPU, quantization="int8").model
    assert all(isinstance(layer, QuantizedLinear) for e in _sparse_experts(model) for layer in e.gate_up)
