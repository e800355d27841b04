"""A tensor-parallel rank's decode step in the fused stack against the same rank's per-op step: two
ranks as threads, a dense Qwen3 with biases and gpt-oss (sinks, windows, sliced experts); every
rank's logits and stored K/V agree, at one row and a batch. Over in-process collectives the stack is
two native calls a layer around its two all-reduces; over a real shared segment with the native
exchange (slots of 64 floats, so every sum takes several exchanges) it is one native call a step."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from pdserve.models.loader import load_model
from pdserve.models.registry import TensorParallelRank
from pdserve.parallel.host_collectives import HostCollectives, shared_memory_check
from pdserve.parallel.host_segment import create_segment, open_segment, unlink_segment
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


class SegmentRank:
    """A rank's collectives over a real shared segment, shaped as a RankGroup's (the stack finds
    `host_collectives` behind its all-reduce)."""

    def __init__(self, collectives: HostCollectives):
        self.host_collectives = collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.host_collectives.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.host_collectives.all_gather(tensor)


@pytest.fixture
def segment_ranks():
    if shared_memory_check(CPU) is not None:
        pytest.skip("the shared-memory path is x86-64 only")
    leader, invite = create_segment(SIZE, 256)
    segments = [leader, *(open_segment(invite, rank) for rank in range(1, SIZE))]
    unlink_segment(invite.path)
    ranks = [SegmentRank(HostCollectives(segment, timeout_s=60)) for segment in segments]
    yield ranks
    for rank in ranks:
        rank.host_collectives.close()


@pytest.mark.parametrize("family,path", [("qwen3", "threads"), ("gpt_oss", "threads"), ("qwen3", "segment"),
                                         ("gpt_oss", "segment")])
def test_a_tensor_parallel_rank_fuses_its_layers_and_matches_its_per_op_step(family, path, request):
    require_native_kernels()
    directory, vocab = {"qwen3": ("qwen_with_biases_dir", QWEN_VOCAB), "gpt_oss": ("gpt_oss_dir", GPT_OSS_VOCAB)}[family]
    directory = request.getfixturevalue(directory)
    if path == "threads":
        parallel = ThreadCollectives(SIZE).rank
    else:
        ranks = request.getfixturevalue("segment_ranks")
        assert all(rank.host_collectives.use_native() for rank in ranks)

        def parallel(rank: int) -> TensorParallelRank:
            return TensorParallelRank(rank, SIZE, ranks[rank].all_reduce, ranks[rank].all_gather)
    runners = [_runner(load_model(directory, torch.float32, CPU, parallel=parallel(rank))) for rank in range(SIZE)]
    for runner in runners:
        stack = runner.decode_step._fused_stack
        assert stack is not None and stack.tensor_parallel
        assert (stack._host is not None) == (path == "segment")  # one native call a step over the segment
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
