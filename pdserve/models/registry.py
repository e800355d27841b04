"""Which model class serves which Hugging Face architecture.

The registry is an explicit table built by `model_registry()`: each entry
pairs a config parser with a model class, so supporting a new architecture is
one line here and an unknown one fails at load with the list of known ones.
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from pdserve.models.base import CausalLM
from pdserve.models.gemma3 import Gemma3ForCausalLM, gemma3_args
from pdserve.models.gpt_oss import GptOssForCausalLM, gpt_oss_args, gpt_oss_sharded_args
from pdserve.models.hf_config import UnsupportedModelFeature
from pdserve.models.llama import LlamaForCausalLM, llama_args, mistral_args, qwen2_args, qwen3_args
from pdserve.models.nemotron_h import (
    NemotronHForCausalLM, NemotronHShardedWeights, nemotron_h_args, nemotron_h_sharded_args)
from pdserve.models.qwen3_5 import (
    GatedQueryShardedWeights, Qwen3_5ForCausalLM, Qwen3NextForCausalLM, qwen3_5_args, qwen3_5_sharded_args,
    qwen3_next_args)
from pdserve.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_args, qwen3_moe_sharded_args
from pdserve.models.tensor_parallel import (
    AllGather, AllReduce, ShardedWeights, TensorParallelShard, shard_for, shard_output_head, sharded_args,
    wrap_row_parallel)
from pdserve.models.weight_loader import WeightLoader, WeightPolicy
from pdserve.models.weights import WeightSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorParallelRank:
    """Which rank of how many builds this model, and how its ranks sum their partial outputs."""

    rank: int
    size: int
    all_reduce: AllReduce
    all_gather: AllGather


@dataclass(frozen=True, slots=True)
class ModelEntry:
    parse_config: Callable[[Mapping[str, Any]], Any]  # HF config dict -> the model's args
    model_class: Callable[[Any, torch.dtype, torch.device], CausalLM]
    # A rank's args from the whole model's (`pdserve.models.tensor_parallel`); MoE families also
    # slice their experts.
    shard_args: Callable[[Any, TensorParallelShard], Any] = sharded_args
    # A rank's slices of the checkpoint's tensors, by name.
    shard_weights: Callable[[WeightSource, TensorParallelShard], WeightSource] = ShardedWeights


# HF model_type -> architecture class name, for configs without `architectures`.
MODEL_TYPES: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
})


def model_registry() -> dict[str, ModelEntry]:
    """HF architecture class name -> how to build it."""
    return {
        "LlamaForCausalLM": ModelEntry(llama_args, LlamaForCausalLM),
        "MistralForCausalLM": ModelEntry(mistral_args, LlamaForCausalLM),
        "Qwen2ForCausalLM": ModelEntry(qwen2_args, LlamaForCausalLM),
        "Qwen3ForCausalLM": ModelEntry(qwen3_args, LlamaForCausalLM),
        "Gemma3ForCausalLM": ModelEntry(gemma3_args, Gemma3ForCausalLM),
        "GptOssForCausalLM": ModelEntry(gpt_oss_args, GptOssForCausalLM, gpt_oss_sharded_args),
        "Qwen3MoeForCausalLM": ModelEntry(qwen3_moe_args, Qwen3MoeForCausalLM, qwen3_moe_sharded_args),
        "NemotronHForCausalLM": ModelEntry(nemotron_h_args, NemotronHForCausalLM, nemotron_h_sharded_args,
                                           NemotronHShardedWeights),
        "Qwen3_5ForCausalLM": ModelEntry(qwen3_5_args, Qwen3_5ForCausalLM, qwen3_5_sharded_args,
                                         GatedQueryShardedWeights),
        "Qwen3NextForCausalLM": ModelEntry(qwen3_next_args, Qwen3NextForCausalLM, qwen3_5_sharded_args,
                                           GatedQueryShardedWeights),
    }


def architecture_of(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        return str(architectures[0])
    return MODEL_TYPES.get(str(config.get("model_type")), str(config.get("model_type")))


def build_model(
    config: Mapping[str, Any], weights: WeightSource, dtype: torch.dtype, device: torch.device,
    policy: WeightPolicy = WeightPolicy(), parallel: TensorParallelRank | None = None,
) -> CausalLM:
    """Instantiate the model class for `config` on `device` and fill it from `weights`,
    keeping or making linear weights quantized as `policy` says; with `parallel`, only this
    rank's shard (`pdserve.models.tensor_parallel`)."""
    registry = model_registry()
    architecture = architecture_of(config)
    entry = registry.get(architecture)
    if entry is None:
        raise UnsupportedModelFeature(
            f"model architecture {architecture!r} is not supported (supported: {sorted(registry)})"
        )
    args = entry.parse_config(config)
    model_kv_heads = args.num_kv_heads
    if parallel is not None and parallel.size > 1:
        shard = shard_for(args, parallel.rank, parallel.size)
        args, weights = entry.shard_args(args, shard), entry.shard_weights(weights, shard)
    model = entry.model_class(args, dtype, device)
    loader = WeightLoader(weights, policy, device)
    model.load_weights(loader)  # type: ignore[attr-defined]
    if parallel is not None and parallel.size > 1:
        wrap_row_parallel(model, parallel.all_reduce)
        shard_output_head(model, parallel.rank, parallel.size, parallel.all_gather)
        model.spec = dataclasses.replace(model.spec, tensor_parallel_size=parallel.size, model_kv_heads=model_kv_heads)
    model.eval()
    logger.info("built %s (%s, %d layers) in %s on %s, %d linear layers in blocks, MXFP4 or bfloat16", architecture,
                model.spec.architecture, model.spec.num_layers, dtype, device, loader.num_compact_layers)
    return model
