"""A tensor-parallel rank's decode step in the fused stack (two native calls a layer, around its
two all-reduces) against the same rank's per-op step: two ranks as threads over in-process
collectives, a dense Qwen3 with biases and gpt-oss (sinks, windows, sliced experts); every rank's
logits and stored K/V agree, at one row and a batch."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from pdserve.models.loader import load_model
from pdserve.runner.decode_step import DecodeStep
from pdserve.runner.fused_layer import FusedLlamaLayer
from tests.engine.step_checks import assert_step_matches_per_op
from tests.engine.test_decode_step import BLOCK_SIZE, _chunk, _prefilled, _runner
from tests.engine.test_fused_layer import qwen_with_biases_dir  # noqa: F401 - a fixture
from tests.models.test_moe_tensor_parallel import ThreadCollectives
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import GPT_OSS_VOCAB, QWEN_VOCAB, make_tiny_gpt_oss, random_prompt

SIZE = 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gpt-oss"))
    make_tiny_gpt_oss(directory, seed=5)
    return directory


def _on_ranks(work: Callable[[int], Any]) -> list:
    """work(rank) on every rank at once, as threads (the collectives pair them up); the results."""
    results: list = [None] * SIZE
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - raised again below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_tensor_parallel_rank_fuses_its_layers_and_matches_its_per_op_step(family, request):
    require_native_kernels()
    directory, vocab = {"qwen3": ("qwen_with_biases_dir", QWEN_VOCAB), "gpt_oss": ("gpt_oss_dir", GPT_OSS_VOCAB)}[family]
    directory = request.getfixturevalue(directory)
    collectives = ThreadCollectives(SIZE)
    runners = [_runner(load_model(directory, torch.float32, CPU, parallel=collectives.rank(rank)))
               for rank in range(SIZE)]
    for runner in runners:
        stack = runner.decode_step._fused_stack
        assert stack is not None and stack.tensor_parallel
        assert not runner.decode_step._stack_norms  # the final norm follows the last all-reduce, in torch
    per_op = [DecodeStep(runner.decode_step.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, CPU,
                         compile_step=False, fuse_layers=False) for runner in runners]
    prompts = [random_prompt(n, vocab, 40 + n) for n in (1, 17, 38)]
    tables = _on_ranks(lambda rank: _prefilled(runners[rank], prompts))[0]
    before = [runner.pool.clone() for runner in runners]
    for rows in ([0], [0, 1, 2]):
        chunks = [_chunk(i, [7 + i], len(prompts[i]), tables[i]) for i in rows]
        _on_ranks(lambda rank: assert_step_matches_per_op(runners[rank], per_op[rank], chunks, before[rank], 1e-4))


def test_a_layer_with_one_row_parallel_part_is_not_fused(qwen_with_biases_dir):  # noqa: F811 - the fixture
    require_native_kernels()
    collectives = ThreadCollectives(SIZE)
    layer = load_model(qwen_with_biases_dir, torch.float32, CPU, parallel=collectives.rank(0)).model.layers[0]
    assert FusedLlamaLayer.of(layer).all_reduces is not None
    layer.mlp.down_proj = layer.mlp.down_proj.inner
    with pytest.raises(ValueError, match="row parallel"):
        FusedLlamaLayer.of(layer)
