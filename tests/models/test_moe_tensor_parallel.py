"""Tensor parallelism for the MoE families, in one process: each rank's expert slices recombine to
the whole expert, expert tensors and sinks meet the right sharding rules, every rank's partial MoE
output sums to the whole layer's (MXFP4 experts sliced after dequantization), and two ranks run as
threads over in-process collectives give transformers' logits (gpt-oss, Qwen3-MoE) and the
one-rank MXFP4 model's; int8 expert slices narrower than a block stay float. Real processes over gloo: tests/integration/test_moe_tensor_parallel.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from pdserve.models.hf_config import ModelLoadError
from pdserve.models.loader import load_model
from pdserve.models.moe import ExpertWeights, SparseMoE
from pdserve.models.moe_sharding import ExpertShard, expert_split_problem
from pdserve.models.quant.modules import Mxfp4Linear, QuantizedLinear
from pdserve.models.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4
from pdserve.models.registry import TensorParallelRank, build_model
from pdserve.models.tensor_parallel import RowParallel, ShardedWeights, TensorParallelShard
from pdserve.models.weights import SafetensorsSource
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.hf_oracle import hf_prompt_logits
from tests.models.test_mxfp4 import _mxfp4_checkpoint
from tests.models.test_tensor_parallel_sharding import DictSource, numbered
from tests.tiny_models import GPT_OSS_VOCAB, QWEN_MOE_VOCAB, make_tiny_gpt_oss, make_tiny_qwen3_moe, random_prompt

pytest.importorskip("transformers")
CPU = torch.device("cpu")
SIZE = 2


class ThreadCollectives:
    """All-reduce and all-gather between ranks that are threads of this process; every rank gets
    the same sum (added in rank order), as gloo gives every rank the same bits."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return gathered

    def rank(self, rank: int) -> TensorParallelRank:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            parts = self._exchange(rank, tensor)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total

        def all_gather(tensor: torch.Tensor) -> torch.Tensor:
            return torch.cat(self._exchange(rank, tensor), dim=-1)

        return TensorParallelRank(rank, self.size, all_reduce, all_gather)


def load_ranks(directory: str, size: int = SIZE, quantization: str = "none") -> list:
    collectives = ThreadCollectives(size)
    return [load_model(directory, torch.float32, CPU, quantization=quantization, parallel=collectives.rank(rank)).model
            for rank in range(size)]


def partial_ranks(directory: str, size: int = SIZE) -> list:
    """Each rank's model with collectives that return the rank's own partial (no sum)."""
    return [load_model(directory, torch.float32, CPU,
                       parallel=TensorParallelRank(rank, size, lambda t: t, lambda t: t)).model for rank in range(size)]


def run_ranks(models: list, prompt: list[int]) -> list[torch.Tensor]:
    """Every rank's prompt logits, the ranks running at once as threads."""
    results: list = [None] * len(models)

    def run(rank: int) -> None:
        results[rank] = forward_chunk(models[rank], ContiguousAttention(models[rank].spec.layer_specs), "s", prompt)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(result is not None for result in results), "a rank failed; see the thread's traceback above"
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (transformers oracle or None, directory)}: float gpt-oss, its MXFP4 twin, Qwen3-MoE."""
    gpt_dir, mxfp4_dir, qwen_dir = (str(tmp_path_factory.mktemp(n)) for n in ("gpt_oss", "mxfp4", "qwen3_moe"))
    gpt_oss = make_tiny_gpt_oss(gpt_dir)
    _mxfp4_checkpoint(gpt_dir, mxfp4_dir)
    return {"gpt_oss": (gpt_oss, gpt_dir), "mxfp4": (None, mxfp4_dir), "qwen3_moe": (make_tiny_qwen3_moe(qwen_dir), qwen_dir)}


# ---- the slicing rules -----------------------------------------------------------------------------


def test_each_ranks_expert_slices_recombine_to_the_whole_expert():
    whole = ExpertWeights(gate=numbered(8, 3), up=-numbered(8, 3), down=numbered(3, 8), gate_bias=torch.arange(8.0),
                          up_bias=-torch.arange(8.0), down_bias=torch.ones(3))
    slices = [ExpertShard(rank, 4).cut(whole) for rank in range(4)]
    assert all(s.gate.shape == (2, 3) and s.down.shape == (3, 2) for s in slices)
    for field in ("gate", "up", "gate_bias", "up_bias"):  # rank r holds units 2r, 2r+1 of gate and up alike
        assert torch.equal(torch.cat([getattr(s, field) for s in slices]), getattr(whole, field))
    assert torch.equal(torch.cat([s.down for s in slices], dim=1), whole.down)
    # down's bias is added once, after the all-reduce: rank 0 holds it, the others zeros.
    assert torch.equal(slices[0].down_bias, whole.down_bias)
    assert all(not s.down_bias.any() for s in slices[1:])
    unbiased = ExpertShard(1, 2).cut(ExpertWeights(gate=numbered(4, 2), up=numbered(4, 2), down=numbered(2, 4)))
    assert unbiased.gate_bias is None and unbiased.down_bias is None


def _mxfp4_expert(width: int, hidden: int, seed: int) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> Mxfp4Weight:
        return Mxfp4Weight.from_blocks(*quantize_mxfp4(torch.randn(rows, cols, generator=generator)))

    return ExpertWeights(gate=matrix(width, hidden), up=matrix(width, hidden), down=matrix(hidden, width),
                         gate_bias=torch.randn(width, generator=generator), up_bias=torch.zeros(width),
                         down_bias=torch.randn(hidden, generator=generator))


@pytest.mark.parametrize("width, stays_mxfp4", [(128, True), (64, False)])
def test_mxfp4_expert_slices_stay_mxfp4_where_the_cut_keeps_whole_groups(width, stays_mxfp4):
    """Two ranks of an expert 128 wide cut down's columns at 64 (whole 32-weight groups): slices stay
    MXFP4; four ranks of one 64 wide cut at 16 columns, inside a group, and dequantize. Either
    way each slice holds exactly the float weights of the same cut of the dequantized expert."""
    whole = _mxfp4_expert(width, 64, seed=width)
    size = 2 if stays_mxfp4 else 4
    for rank in range(size):
        sliced = ExpertShard(rank, size).cut(whole)
        assert isinstance(sliced.down, Mxfp4Weight) is stays_mxfp4
        assert isinstance(sliced.gate, Mxfp4Weight) is stays_mxfp4
        expected = ExpertShard(rank, size).cut(whole.dequantized())
        for field in ("gate", "up", "down", "gate_bias", "down_bias"):
            got = getattr(sliced, field)
            got = got.dequantize() if isinstance(got, Mxfp4Weight) else got
            assert torch.equal(got, getattr(expected, field)), field


def test_expert_tensors_pass_whole_and_sinks_follow_their_query_heads():
    prefix = "model.layers.0."
    tensors = {prefix + "self_attn.sinks": torch.arange(4.0),
               prefix + "mlp.experts.gate_up_proj": numbered(6, 16).view(3, 2, 16),
               prefix + "mlp.experts.gate_up_proj_blocks": torch.zeros(3, 16, 2, 16, dtype=torch.uint8),
               prefix + "mlp.experts.1.gate_proj.weight": numbered(32, 4),  # Qwen3-MoE's per-expert layout
               prefix + "mlp.experts.1.down_proj.weight": numbered(4, 32),
               prefix + "mlp.router.weight": numbered(3, 16), prefix + "mlp.gate.weight": numbered(3, 16)}
    source = DictSource(tensors)
    ranks = [ShardedWeights(source, TensorParallelShard(rank, 2, 4, 2, 16, 128)) for rank in range(2)]
    assert torch.equal(ranks[0].get(prefix + "self_attn.sinks"), torch.tensor([0.0, 1.0]))
    assert torch.equal(ranks[1].get(prefix + "self_attn.sinks"), torch.tensor([2.0, 3.0]))
    for name in tensors:
        if "sinks" not in name:  # cut per expert by the model file, or replicated (routers)
            assert all(torch.equal(rank.get(prefix + name.removeprefix(prefix)), tensors[name]) for rank in ranks)


def test_an_expert_width_the_ranks_do_not_divide_is_refused_naming_it(checkpoints):
    assert expert_split_problem(32, 3) == "--tensor-parallel-size 3 does not divide the model's expert width 32"
    assert expert_split_problem(32, 2) is None
    _, directory = checkpoints["qwen3_moe"]
    config = json.load(open(os.path.join(directory, "config.json")))
    config["moe_intermediate_size"] = 33
    rank = TensorParallelRank(0, 2, lambda t: t, lambda t: t)
    with SafetensorsSource(directory) as source, pytest.raises(ModelLoadError, match="expert width 33"):
        build_model(config, source, torch.float32, CPU, parallel=rank)


# ---- loaded models -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt_oss", "mxfp4", "qwen3_moe"])
def test_every_ranks_partial_moe_output_sums_to_the_whole_layer(checkpoints, name):
    """The loaded slices (MXFP4: of the dequantized weights) recombine to the one-rank model's
    experts, and the ranks' partial outputs of each MoE layer sum to its whole output."""
    _, directory = checkpoints[name]
    whole = load_model(directory, torch.float32, CPU).model
    ranks = partial_ranks(directory)
    x = torch.randn(23, whole.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    num_sparse = 0
    for layer_id, layer in enumerate(whole.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        num_sparse += 1
        rank_moes = [model.layers[layer_id].mlp for model in ranks]
        assert all(isinstance(moe.experts, RowParallel) for moe in rank_moes)
        experts = [moe.experts.inner for moe in rank_moes]
        for e in range(layer.mlp.experts.num_experts):
            halves = [ex.gate_up[e].weight.chunk(2) for ex in experts]  # each rank: its gate rows, its up rows
            gate, up = layer.mlp.experts.gate_up[e].weight.chunk(2)
            assert torch.equal(torch.cat([h[0] for h in halves]), gate)
            assert torch.equal(torch.cat([h[1] for h in halves]), up)
            assert torch.equal(torch.cat([ex.down[e].weight for ex in experts], dim=1), layer.mlp.experts.down[e].weight)
        with torch.inference_mode():
            summed = sum(moe(x) for moe in rank_moes)
            torch.testing.assert_close(summed, layer.mlp(x), atol=1e-5, rtol=1e-5)
    assert num_sparse == (3 if name == "qwen3_moe" else 4)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_two_ranks_give_transformers_logits(checkpoints, name):
    oracle, directory = checkpoints[name]
    vocab = GPT_OSS_VOCAB if name == "gpt_oss" else QWEN_MOE_VOCAB
    prompt = random_prompt(50, vocab, 7)  # longer than gpt-oss's 16-token window
    expected = hf_prompt_logits(oracle, prompt)
    for logits in run_ranks(load_ranks(directory), prompt):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_two_ranks_of_an_mxfp4_checkpoint_give_the_one_rank_logits(checkpoints):
    _, directory = checkpoints["mxfp4"]
    whole = load_model(directory, torch.float32, CPU).model
    prompt = random_prompt(40, GPT_OSS_VOCAB, 8)
    expected = forward_chunk(whole, ContiguousAttention(whole.spec.layer_specs), "s", prompt)
    for logits in run_ranks(load_ranks(directory), prompt):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_two_ranks_keep_mxfp4_slices_of_whole_groups_and_give_the_one_rank_logits(tmp_path_factory):
    """Experts 64 wide: each of two ranks keeps 32 units of every expert, whole MXFP4 groups, so its
    slices stay MXFP4 (the native experts read them) and the ranks still sum to the one-rank model."""
    float_dir, mxfp4_dir = (str(tmp_path_factory.mktemp(n)) for n in ("wide_gpt_oss", "wide_mxfp4"))
    make_tiny_gpt_oss(float_dir, intermediate_size=64)
    _mxfp4_checkpoint(float_dir, mxfp4_dir)
    whole = load_model(mxfp4_dir, torch.float32, CPU).model
    ranks = load_ranks(mxfp4_dir)
    for model in ranks:
        experts = model.layers[0].mlp.experts.inner
        assert isinstance(experts.down[0], Mxfp4Linear) and experts.down[0].in_features == 32
    prompt = random_prompt(40, GPT_OSS_VOCAB, 9)
    expected = forward_chunk(whole, ContiguousAttention(whole.spec.layer_specs), "s", prompt)
    for logits in run_ranks(ranks, prompt):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_int8_expert_slices_too_narrow_for_whole_blocks_stay_float(checkpoints):
    """Each rank's down projection reads 16 of an expert's 32 units: less than one 32-weight block,
    so it stays float while gate|up (64 inputs) is quantized; the model still tracks transformers."""
    oracle, directory = checkpoints["gpt_oss"]
    ranks = load_ranks(directory, quantization="int8")
    experts = ranks[1].layers[0].mlp.experts.inner
    assert all(isinstance(linear, QuantizedLinear) for linear in experts.gate_up)
    assert not any(isinstance(linear, QuantizedLinear) for linear in experts.down)
    prompt = random_prompt(40, GPT_OSS_VOCAB, 2)
    expected = hf_prompt_logits(oracle, prompt).argmax(-1)
    for logits in run_ranks(ranks, prompt):
        assert (logits.argmax(-1) == expected).float().mean().item() >= 0.9
