"""gpt-oss and Qwen3-MoE decode layers in the fused stack (attention sinks, sliding windows, the
native experts in place of the gated MLP) against the per-op decode step with the torch experts:
same logits, same stored K/V, float and quantized, at one row and a batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.loader import load_model
from pdserve.models.moe import Experts
from pdserve.runner.decode_step import DecodeStep
from pdserve.runner.fused_layer import unfusable_reason
from tests.engine.step_checks import assert_step_matches_per_op
from tests.engine.test_decode_step import BLOCK_SIZE, _chunk, _prefilled, _runner
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import GPT_OSS_VOCAB, QWEN_MOE_VOCAB, make_tiny_gpt_oss, make_tiny_qwen3_moe, random_prompt

VOCABS = {"gpt_oss": GPT_OSS_VOCAB, "qwen3_moe": QWEN_MOE_VOCAB}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    gpt_oss, qwen3_moe = str(tmp_path_factory.mktemp("gpt-oss")), str(tmp_path_factory.mktemp("qwen3-moe"))
    make_tiny_gpt_oss(gpt_oss, seed=5)
    make_tiny_qwen3_moe(qwen3_moe, seed=6)
    return {"gpt_oss": gpt_oss, "qwen3_moe": qwen3_moe}


def _torch_experts(model) -> None:
    for module in model.modules():
        if isinstance(module, Experts):
            module.native_enabled = False


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_fused_moe_step_matches_the_per_op_step_with_torch_experts(checkpoints, family, quantization):
    require_native_kernels()
    loaded = load_model(checkpoints[family], torch.float32, torch.device("cpu"), quantization)
    runner = _runner(loaded)
    assert runner.decode_step._fused is not None, unfusable_reason(loaded.model, runner.device)
    assert any(layer.moe is not None for layer in runner.decode_step._fused)
    reference_model = load_model(checkpoints[family], torch.float32, torch.device("cpu"), quantization).model
    _torch_experts(reference_model)
    per_op = DecodeStep(reference_model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                        compile_step=False, fuse_layers=False)
    # Prompts past the sliding window (16), so that windowed layers skip keys.
    prompts = [random_prompt(n, VOCABS[family], 50 + n) for n in (1, 19, 37, 40)]
    tables = _prefilled(runner, prompts)
    before = runner.pool.clone()
    tolerance = 1e-4
    for rows in ([2], [0, 1, 2, 3]):
        chunks = [_chunk(i, [7 + i], len(prompts[i]), tables[i]) for i in rows]
        assert_step_matches_per_op(runner, per_op, chunks, before, tolerance)


def test_turning_the_native_experts_off_keeps_the_per_op_step(checkpoints):
    require_native_kernels()
    loaded = load_model(checkpoints["gpt_oss"], torch.float32, torch.device("cpu"))
    _torch_experts(loaded.model)
    reason = unfusable_reason(loaded.model, torch.device("cpu"))
    assert reason is not None and "native path" in reason
