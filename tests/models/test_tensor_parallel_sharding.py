"""Sharding a checkpoint over tensor-parallel ranks: each rank's slice of each weight, KV-head
replication, biases added once, quantized blocks cut only on block boundaries, and clear errors
for sizes that do not fit."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.hf_config import ModelLoadError
from pdserve.models.quant.blocks import dequantize, quantize_q8_0
from pdserve.models.tensor_parallel import (
    ShardedWeights, TensorParallelShard, shard_for, sharded_args, tensor_parallel_problem)
from pdserve.models.llama import llama_args

HEAD_DIM = 4


class DictSource:
    def __init__(self, tensors: dict[str, torch.Tensor], packed: dict | None = None):
        self.tensors, self.packed = tensors, packed or {}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_packed(self, name: str):
        return self.packed.get(name)


def numbered(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)


def shard(rank: int, size: int, heads: int, kv_heads: int, mlp: int = 64) -> TensorParallelShard:
    return TensorParallelShard(rank, size, heads, kv_heads, HEAD_DIM, mlp)


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_the_numbers():
    assert tensor_parallel_problem(2, 9, 3, 1536) == (
        "--tensor-parallel-size 2 does not divide the model's 9 attention heads (sizes that do: [1, 3, 9])")
    assert tensor_parallel_problem(6, 12, 3, 1536) is None  # each KV head replicated to two ranks
    assert "4 KV heads" in tensor_parallel_problem(3, 12, 4, 1536)
    assert "MLP width 100" in tensor_parallel_problem(3, 9, 3, 100)
    assert tensor_parallel_problem(3, 9, 3, 1536) is None and tensor_parallel_problem(1, 9, 3, 7) is None
    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 8}
    with pytest.raises(ModelLoadError, match="does not divide the model's 9 attention heads"):
        shard_for(llama_args(config), 0, 2)
    args = sharded_args(llama_args(config), shard_for(llama_args(config), 1, 3))
    assert (args.num_heads, args.num_kv_heads, args.intermediate_size, args.hidden_size) == (3, 1, 512, 576)


def test_column_parallel_rows_and_row_parallel_columns_are_each_ranks_heads():
    prefix = "model.layers.0."
    source = DictSource({prefix + "self_attn.q_proj.weight": numbered(8 * HEAD_DIM, 6),
                         prefix + "self_attn.k_proj.weight": numbered(2 * HEAD_DIM, 6),
                         prefix + "self_attn.o_proj.weight": numbered(6, 8 * HEAD_DIM),
                         prefix + "self_attn.o_proj.bias": torch.ones(6),
                         prefix + "mlp.up_proj.weight": numbered(64, 6),
                         prefix + "mlp.down_proj.weight": numbered(6, 64),
                         prefix + "input_layernorm.weight": torch.arange(6.0)})
    full = source.tensors
    pieces = [ShardedWeights(source, shard(rank, 2, heads=8, kv_heads=2)) for rank in range(2)]
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.up_proj.weight"):
        assert torch.equal(torch.cat([p.get(prefix + name) for p in pieces]), full[prefix + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([p.get(prefix + name) for p in pieces], dim=1), full[prefix + name])
    # The row-parallel bias is added once, after the sum: rank 0 holds it, the others zeros.
    assert torch.equal(sum(p.get(prefix + "self_attn.o_proj.bias") for p in pieces), full[prefix + "self_attn.o_proj.bias"])
    assert torch.equal(pieces[1].get(prefix + "input_layernorm.weight"), full[prefix + "input_layernorm.weight"])


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head_to_the_ranks_whose_queries_use_it():
    k = numbered(2 * HEAD_DIM, 3)  # 2 KV heads, 4 ranks, 8 query heads: ranks 0-1 use KV head 0, 2-3 head 1
    source = DictSource({"model.layers.0.self_attn.k_proj.weight": k})
    heads = [ShardedWeights(source, shard(rank, 4, heads=8, kv_heads=2)).get("model.layers.0.self_attn.k_proj.weight")
             for rank in range(4)]
    assert all(h.shape == (HEAD_DIM, 3) for h in heads)
    assert torch.equal(heads[0], k[:HEAD_DIM]) and torch.equal(heads[1], k[:HEAD_DIM])
    assert torch.equal(heads[2], k[HEAD_DIM:]) and torch.equal(heads[3], k[HEAD_DIM:])


def test_quantized_blocks_are_cut_on_block_boundaries_or_left_to_be_dequantized():
    weight = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    packed = quantize_q8_0(weight)
    name = "model.layers.0.mlp.down_proj.weight"
    source = DictSource({name: dequantize(packed)}, {name: packed})
    halves = [ShardedWeights(source, shard(rank, 2, 8, 2, mlp=128)).get_packed(name) for rank in range(2)]
    assert [half.in_features for half in halves] == [64, 64]
    assert torch.equal(torch.cat([dequantize(half) for half in halves], dim=1), dequantize(packed))
    # 128 / 8 = 16 columns a rank: that cuts a 32-weight block, so the loader gets floats instead.
    assert ShardedWeights(source, shard(1, 8, 8, 8, mlp=128)).get_packed(name) is None
    rows = DictSource({"model.layers.0.mlp.up_proj.weight": weight}, {"model.layers.0.mlp.up_proj.weight": packed})
    top = ShardedWeights(rows, shard(0, 2, 8, 2, mlp=6)).get_packed("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(dequantize(top), dequantize(packed)[:3])
