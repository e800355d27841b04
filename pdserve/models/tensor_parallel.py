"""Megatron-style sharding of a model over tensor-parallel ranks: which heads and rows each rank owns.

Rank r of N builds the same model class with fewer heads and a narrower MLP, and loads only its
slice of each weight through `ShardedWeights` (a `WeightSource` over the full checkpoint):

    q/k/v, gate/up  (column parallel)  output rows split:  rank r gets its heads / its MLP rows
    o, down         (row parallel)     input columns split; the partial sums are all-reduced
    attention sinks                    one per query head: rank r gets its heads' sinks
    experts (MoE)                      a slice of every expert, cut by the model file after any
                                       dequantization (`moe_sharding`); one all-reduce after them
    LM head         (vocab parallel)   vocabulary rows split; the logits are all-gathered
    embedding, norms, MoE router       replicated
    state mixers (Gated DeltaNet,      heads (and Mamba2 groups) split, never replicated: the model
      Mamba2)                          file cuts their tensors (`state_sharding`); out_proj row parallel

    q heads  0 1 2 3 | 4 5 6 7      N=2, 8 q heads, 2 KV heads: rank 0 owns q 0-3 and KV head 0
    kv heads 0       | 1

    q heads  0 1 | 2 3              N=2, 4 q heads, 1 KV head: the KV head is replicated, every
    kv heads 0   | 0                rank owns it and keeps its own copy of its K/V

The LM head is split because it is a large share of a decode step on models with a big
vocabulary (SmolLM2, one thread: the head 1.2 ms against 4.8 ms for all 30 layers' matmuls); kept
whole, rank 0 would compute it alone while the other ranks wait, 43% of its matmul time at
TP=3. The embedding stays whole: a lookup of a few rows costs nothing worth a collective.
A row-parallel layer's bias is added once: rank 0 loads it, the others load zeros. Quantized
GGUF blocks are sliced on block boundaries (32 weights); a slice that would cut a block is
dequantized instead. Invariant: the sum over ranks of every row-parallel output equals the
unsharded layer's output, so norms, RoPE, sliding windows and soft-capping are untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from pdserve.kv.head_split import heads_split_problem, rank_kv_heads
from pdserve.models.hf_config import ModelLoadError
from pdserve.models.moe import SparseMoE
from pdserve.models.quant.blocks import GROUP_SIZE, PackedWeight
from pdserve.models.quant.modules import QuantizedLinear
from pdserve.models.weight_targets import Linear
from pdserve.models.weights import WeightSource

logger = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], torch.Tensor]
AllGather = Callable[[torch.Tensor], torch.Tensor]  # [n, k] on each rank -> [n, size * k], rank order


@dataclass(frozen=True, slots=True)
class TensorParallelShard:
    """This rank's place among `size` ranks, and the full model's head counts."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds: a share, or one replicated head when there are fewer than ranks."""
        return rank_kv_heads(self.num_kv_heads, self.size, self.rank)[1]

    @property
    def first_kv_head(self) -> int:
        return rank_kv_heads(self.num_kv_heads, self.size, self.rank)[0]

    def q_heads(self) -> slice:
        return _span(self.rank * self.heads_per_rank, self.heads_per_rank)

    def q_rows(self) -> slice:
        return _span(self.rank * self.heads_per_rank * self.head_dim, self.heads_per_rank * self.head_dim)

    def kv_rows(self) -> slice:
        return _span(self.first_kv_head * self.head_dim, self.kv_heads_per_rank * self.head_dim)

    def mlp_rows(self) -> slice:
        width = self.intermediate_size // self.size
        return _span(self.rank * width, width)


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


def tensor_parallel_problem(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> Optional[str]:
    """Why a model cannot be split over `size` ranks (None when it can); names the numbers."""
    if size == 1:
        return None
    if num_heads % size:
        return (f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention heads "
                f"(sizes that do: {_divisors(num_heads)})")
    kv_problem = heads_split_problem(num_kv_heads, size)
    if kv_problem is not None:
        return f"--tensor-parallel-size {size}: {kv_problem}"
    if intermediate_size % size:
        return f"--tensor-parallel-size {size} does not divide the model's MLP width {intermediate_size}"
    return None


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def shard_for(args: Any, rank: int, size: int) -> TensorParallelShard:
    """The shard of a model's parsed args (any family with heads, KV heads, head_dim and an MLP width);
    ModelLoadError when `size` does not fit the model."""
    problem = tensor_parallel_problem(size, args.num_heads, args.num_kv_heads, args.intermediate_size)
    if problem is not None:
        raise ModelLoadError(problem)
    return TensorParallelShard(rank, size, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size)


def sharded_args(args: Any, shard: TensorParallelShard) -> Any:
    """The args a rank builds its model from: its heads and its slice of the MLP."""
    return dataclasses.replace(args, num_heads=shard.heads_per_rank, num_kv_heads=shard.kv_heads_per_rank,
                               intermediate_size=shard.intermediate_size // shard.size)


_COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW_PARALLEL = {"o_proj": "q", "down_proj": "mlp"}
# Expert tensors pass whole: the model file cuts each expert after taking fused layouts apart and
# dequantizing (`pdserve.models.moe_sharding`); their names must not meet the dense MLP's rules.
_EXPERTS = ".mlp.experts."
_SINKS = "sinks"  # gpt-oss's `self_attn.sinks`: one logit per query head


class ShardedWeights:
    """A `WeightSource` that hands out this rank's slice of each tensor (by Hugging Face name)."""

    def __init__(self, source: WeightSource, shard: TensorParallelShard):
        self.source = source
        self.shard = shard

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def _rule(self, name: str) -> tuple[Optional[str], Optional[slice]]:
        """("column" | "row" | None, the slice of the split dimension) for `name`."""
        parts = name.rsplit(".", 2)
        if len(parts) != 3 or _EXPERTS in name:
            return None, None
        module = parts[1]
        if parts[2] == _SINKS and module == "self_attn":
            return "column", self.shard.q_heads()
        spans = {"q": self.shard.q_rows, "kv": self.shard.kv_rows, "mlp": self.shard.mlp_rows}
        if module in _COLUMN_PARALLEL:
            return "column", spans[_COLUMN_PARALLEL[module]]()
        if module in _ROW_PARALLEL:
            return "row", spans[_ROW_PARALLEL[module]]()
        return None, None

    def get(self, name: str) -> torch.Tensor:
        tensor = self.source.get(name)
        kind, span = self._rule(name)
        if kind == "column":
            return tensor[span].contiguous()
        if kind == "row" and name.endswith(".bias"):
            return tensor if self.shard.rank == 0 else torch.zeros_like(tensor)  # added once, after the sum
        if kind == "row":
            return tensor[:, span].contiguous()
        return tensor

    def get_packed(self, name: str) -> Optional[PackedWeight]:
        """The slice as blocks; None (the loader dequantizes) when the source has no blocks or the
        slice would cut a quantization block."""
        packed = self.source.get_packed(name)
        kind, span = self._rule(name)
        if packed is None or kind is None:
            return packed
        if kind == "column":
            return PackedWeight(packed.blocks[span].contiguous(), packed.format, packed.in_features)
        if span.start % GROUP_SIZE or span.stop % GROUP_SIZE:
            logger.warning("%s: rank %d's columns %d-%d cut a %d-weight block; dequantizing this weight",
                           name, self.shard.rank, span.start, span.stop, GROUP_SIZE)
            return None
        width = packed.format.block_bytes
        columns = slice(span.start // GROUP_SIZE * width, span.stop // GROUP_SIZE * width)
        return PackedWeight(packed.blocks[:, columns].contiguous(), packed.format, span.stop - span.start)


class RowParallel(torch.nn.Module):
    """A row-parallel linear layer: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: torch.nn.Module, all_reduce: AllReduce):
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.inner(*inputs))


def wrap_row_parallel(model: torch.nn.Module, all_reduce: AllReduce) -> None:
    """Sum each layer's attention output projection and MLP down projection over the ranks; in a
    mixture-of-experts layer, the experts' combined output (one all-reduce, however many experts ran).
    A model whose blocks differ (the hybrids) names its own row-parallel projections by
    `row_parallel_slots()`: (module, attribute) pairs."""
    slots = getattr(model, "row_parallel_slots", None)
    if slots is not None:
        for owner, name in slots():
            setattr(owner, name, RowParallel(getattr(owner, name), all_reduce))
        return
    for layer in model.layers:  # type: ignore[union-attr]
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, all_reduce)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.experts = RowParallel(layer.mlp.experts, all_reduce)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, all_reduce)


def vocab_rows(vocab_size: int, rank: int, size: int) -> slice:
    """Rank r's rows of the output head: equal shares, the last one shorter when the vocabulary
    does not divide (its logits are padded for the gather, then cut)."""
    share = -(-vocab_size // size)
    return slice(min(rank * share, vocab_size), min((rank + 1) * share, vocab_size))


def _head_rows(head: torch.nn.Module, rows: slice) -> torch.nn.Module:
    """An output head made of `rows` of `head` (float or blocks), in its own storage."""
    if isinstance(head, QuantizedLinear):
        return QuantizedLinear(PackedWeight(head.blocks[rows].clone(), head.format, head.in_features))
    weight = head.weight[rows].clone()  # type: ignore[index]
    sliced = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    sliced.weight = torch.nn.Parameter(weight, requires_grad=False)
    return sliced


class VocabParallelHead(torch.nn.Module):
    """The output head over this rank's vocabulary rows; every rank gets all the logits."""

    def __init__(self, inner: torch.nn.Module, vocab_size: int, share: int, all_gather: AllGather):
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.share = share
        self.all_gather = all_gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x)
        if local.shape[-1] < self.share:
            local = torch.nn.functional.pad(local, (0, self.share - local.shape[-1]))
        return self.all_gather(local.contiguous())[..., : self.vocab_size]


def shard_output_head(model: torch.nn.Module, rank: int, size: int, all_gather: AllGather) -> None:
    """Keep only this rank's vocabulary rows of the (loaded, possibly tied) output head."""
    vocab_size = model.spec.vocab_size  # type: ignore[union-attr]
    rows = vocab_rows(vocab_size, rank, size)
    head = _head_rows(model.lm_head, rows)  # type: ignore[arg-type]
    model.lm_head = VocabParallelHead(head, vocab_size, -(-vocab_size // size), all_gather)
