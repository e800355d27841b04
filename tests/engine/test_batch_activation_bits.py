"""`--batch-activation-bits`: the setting reaches the fused decode stack; 22 bits (the default) keep a
batched step at the one-row kernel's rounding, 8 bits round batched rows coarser (not single rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from bench.kernels.q4_1 import compiled_lane_widths
from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.models.loader import load_model
from pdserve.runner.decode_step import DecodeStep
from tests.engine.test_decode_step import BLOCK_SIZE, _chunk, _prefilled, _runner
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import QWEN_VOCAB, make_tiny_qwen3, random_prompt


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return directory


def test_only_the_bits_the_kernels_round_to_are_accepted_and_the_flag_reaches_the_config():
    from pdserve.app.cli import build_parser, worker_config

    assert ModelConfig().batch_activation_bits == 22
    with pytest.raises(ValidationError, match="batch-activation-bits"):
        ModelConfig(batch_activation_bits=12)
    args = build_parser().parse_args(["serve", "--batch-activation-bits", "8"])
    assert worker_config(args, "colocated").model.batch_activation_bits == 8


@pytest.mark.parametrize("bits, digits", [(22, 3), (8, 1)])
def test_the_setting_reaches_the_fused_stack(qwen_dir, bits, digits):
    require_native_kernels()
    from pdserve.app.engine_factory import build_engine
    from pdserve.metrics import Metrics

    config = WorkerConfig(model=ModelConfig(path=qwen_dir, device="cpu", quantization="int4", batch_activation_bits=bits),
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_running=16))
    built = build_engine(config, Metrics())
    assert built.runner.decode_step._fused_stack.batch_activation_digits == digits


def test_eight_bit_batches_move_batched_logits_a_little_and_leave_one_row_alone(qwen_dir):
    require_native_kernels()
    loaded = load_model(qwen_dir, torch.float32, torch.device("cpu"), "int4")
    runner = _runner(loaded)
    assert runner.decode_step._fused is not None
    coarse = DecodeStep(loaded.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                        compile_step=False, batch_activation_digits=1)
    prompts = [random_prompt(3 + n, QWEN_VOCAB, 60 + n) for n in range(16)]
    tables = _prefilled(runner, prompts)
    before = runner.pool.clone()
    chunks = [_chunk(i, [7 + i], len(prompts[i]), tables[i]) for i in range(16)]

    def logits(step: DecodeStep, rows: list) -> torch.Tensor:
        runner.pool.copy_(before)
        with torch.inference_mode():
            return step.run(rows)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the lanes run on one thread only
        exact, rounded = logits(runner.decode_step, chunks), logits(coarse, chunks)
    finally:
        torch.set_num_threads(threads)
    if 16 in compiled_lane_widths():  # AVX2 alone keeps batches on the float tiles at any setting
        assert not torch.equal(exact, rounded)  # 16 rows: the integer lanes at 8 bits
    assert float(F.cosine_similarity(exact, rounded, dim=-1).min()) > 0.99
    assert torch.equal(logits(runner.decode_step, chunks[:1]), logits(coarse, chunks[:1]))  # the one-row kernel
