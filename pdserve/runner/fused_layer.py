"""One native call per decoder layer in a decode step (`pdserve_cpu::llama_decode_layer`).

A decode step at one row spends most of its time dispatching small torch ops from Python (about
120 a layer: norms, RoPE, activations, residuals, views), not multiplying. The native kernel
runs a whole Llama-family layer (norms, q/k/v, optional q/k norm, RoPE, paged attention, o, the
gated SiLU MLP, both residuals) in C++; gpt-oss's and Qwen3-MoE's layers add attention sinks and a
mixture of experts in place of the gated MLP (`moe_native.py`). This module gathers each layer's
arguments once, at start-up. Invariant: a layer is fused only when the kernel computes exactly
what the torch layer does (float32 activations on the CPU, SiLU or the experts' known
activations, rotation over the whole head, weights float32 or in blocks the kernels read); any
other layer makes the whole model keep the torch path, and `unfusable_reason` says why.

A tensor-parallel rank's layers fuse too: their row-parallel projections (`RowParallel`: o, down
or the experts) run unwrapped in the kernel, and each partial is summed over the ranks before it
is added to the stream:

    h += all_reduce(attention_partial(h))      norm, q|k|v, rope, attend, store K/V, o
    h += all_reduce(mlp_partial(h))            post norm, gated MLP or experts, down

Where the ranks share a host segment whose all-reduce runs natively (HostCollectives.use_native),
the whole stack is one native call that sums through it (`forward_ranked`); otherwise (gloo, no
native exchange) a layer is two native calls and the all-reduces run in Python between them.
Either way the same bits: the sums are the same additions in the same rank order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from pdserve.runner.decode_attention import DecodeRows
from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.base import CausalLM, DecoderLayer
from pdserve.models.gpt_oss import GptOssDecoderLayer
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pdserve.models.moe import SparseMoE
from pdserve.models.moe_native import FLOAT_WEIGHT, native_experts, native_weight
from pdserve.models.qwen3_moe import Qwen3MoeDecoderLayer
from pdserve.models.tensor_parallel import AllReduce, RowParallel

@dataclass(frozen=True)
class FusedLlamaLayer:
    """The fixed arguments of one layer's native call."""

    norms: tuple[torch.Tensor, torch.Tensor]  # input, post-attention
    qk_norm: Optional[torch.Tensor]
    weights: tuple[torch.Tensor, ...]  # qkv, o, gate|up, down
    formats: tuple[int, ...]
    biases: tuple[Optional[torch.Tensor], ...]
    geometry: tuple[int, int, int]  # heads, kv heads, head dim
    eps: float
    scale: float
    sinks: Optional[torch.Tensor] = None  # gpt-oss: one logit per query head
    moe: Any = None  # a `SparseMoeMlp` in place of the gated MLP (whose weights are then empty)
    all_reduces: Optional[tuple[AllReduce, AllReduce]] = None  # a tensor-parallel rank's, after o and the MLP

    @classmethod
    def of(cls, layer: DecoderLayer) -> "FusedLlamaLayer":
        """ValueError when `layer` is not one the kernel computes exactly."""
        if type(layer) not in (LlamaDecoderLayer, Qwen3MoeDecoderLayer, GptOssDecoderLayer):
            raise ValueError(f"{type(layer).__name__} layers have no fused kernel")
        attention, mlp = layer.self_attn, layer.mlp
        if isinstance(layer, GptOssDecoderLayer):
            norms = (layer.norms[0].detach(), layer.norms[1].detach())
            activations = mlp.router_weight  # the model's dtype and device (its norms are float32 always)
        else:
            norms = (layer.input_norm.detach(), layer.post_attention_norm.detach())
            activations = layer.input_norm
        if activations.dtype != torch.float32 or activations.device.type != "cpu":
            raise ValueError("activations are not float32 on the CPU")
        o_proj, attention_reduce = _row_parallel_parts(attention.o_proj)
        parts = [native_weight(linear) for linear in (attention.qkv_proj, o_proj)]
        moe = None
        if isinstance(mlp, SparseMoE):
            experts, mlp_reduce = _row_parallel_parts(mlp.experts)
            moe = _native_moe(mlp, experts)
            no_weight = torch.empty(0)
            parts += [(no_weight, FLOAT_WEIGHT, None), (no_weight, FLOAT_WEIGHT, None)]
        else:
            if mlp.activation is not F.silu:
                raise ValueError("the MLP's activation is not SiLU")
            down_proj, mlp_reduce = _row_parallel_parts(mlp.down_proj)
            parts += [native_weight(linear) for linear in (mlp.gate_up_proj, down_proj)]
        if (attention_reduce is None) != (mlp_reduce is None):
            raise ValueError("only one of the attention output and the MLP is row parallel")
        sinks = layer.attention_sinks
        return cls(
            norms=norms,
            qk_norm=None if attention.qk_norm is None else attention.qk_norm.detach(),
            weights=tuple(weight for weight, _, _ in parts),
            formats=tuple(number for _, number, _ in parts),
            biases=tuple(bias for _, _, bias in parts),
            geometry=(attention.num_heads, attention.num_kv_heads, attention.head_dim),
            eps=layer.eps,
            scale=layer.attention_scale,
            sinks=None if sinks is None else sinks.detach(),
            moe=moe,
            all_reduces=None if attention_reduce is None else (attention_reduce, mlp_reduce),
        )

    def __call__(self, h: torch.Tensor, rope: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows,
                 write_blocks: torch.Tensor, write_offsets: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer; the rows' new K/V are stored in their page slots
        (int64 block ids and offsets), after attending, which reads other slots only."""
        if self.sinks is not None or self.moe is not None or self.all_reduces is not None:
            raise ValueError("a layer with sinks, experts or all-reduces runs in a FusedDecoderStack only")
        cos, sin = rope
        h, _, _ = ops().llama_decode_layer(
            h, list(self.norms), self.qk_norm, list(self.weights), list(self.formats), list(self.biases), cos, sin,
            k_cache, v_cache, rows.block_table, rows.key_start, rows.key_end, write_blocks, write_offsets,
            list(self.geometry), self.eps, self.scale,
        )
        return h


class FusedDecoderStack:
    """Every fused layer of a model as one native object (`pdserve_cpu::LlamaDecoderStack`): a
    decode step calls it once instead of once per layer, each layer's fixed arguments and page
    views handed over at start-up."""

    def __init__(self, layers: Sequence[FusedLlamaLayer], layer_caches: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
                 final_norm: Optional[tuple[torch.Tensor, float]] = None, batch_activation_digits: int = 3,
                 one_row_tiles: bool = True):
        """`final_norm`: (weight, eps) of the model's final RMSNorm (`native_final_norm`), which the
        stack then applies after the last layer (`applies_final_norm`; a tensor-parallel rank's
        stack leaves it to the caller). `batch_activation_digits`: 7-bit digits per activation in the
        Q4_1 products of batched steps (3: the one-row kernel's 22 bits; 2 or 1: faster, coarser).
        `one_row_tiles`: where the CPU has AVX-512 VNNI, each Q4_1 weight is copied once more in the
        layout steps of 1-2 rows multiply fastest (batch-1 bits; `one_row_tile_bytes` says how many)."""
        self._stack = torch.classes.pdserve_cpu.LlamaDecoderStack()
        self._stack.set_batch_activation_digits(batch_activation_digits)
        self._stack.set_one_row_tiles(one_row_tiles)
        self._all_reduces = [layer.all_reduces for layer in layers]
        self.tensor_parallel = any(reduces is not None for reduces in self._all_reduces)
        if self.tensor_parallel and not all(reduces is not None for reduces in self._all_reduces):
            raise ValueError("some layers are tensor parallel and some are not")
        self._host = _shared_host_collectives(self._all_reduces) if self.tensor_parallel else None
        self.applies_final_norm = final_norm is not None and not self.tensor_parallel
        if self.applies_final_norm:
            self._stack.set_final_norm(final_norm[0], final_norm[1])
        no_bias = torch.empty(0)
        for layer, (group_id, k_cache, v_cache) in zip(layers, layer_caches, strict=True):
            self._stack.add_layer(list(layer.norms), layer.qk_norm, list(layer.weights), list(layer.formats),
                                  [no_bias if bias is None else bias for bias in layer.biases], list(layer.geometry),
                                  layer.eps, layer.scale, k_cache, v_cache, group_id)
            if layer.sinks is not None:
                self._stack.attach_sinks(layer.sinks)
            if layer.moe is not None:
                self._stack.attach_moe(layer.moe)

    @property
    def one_row_tile_bytes(self) -> int:
        """Bytes of the Q4_1 weights' one-row copies (0: none made)."""
        return self._stack.one_row_tile_bytes()

    @property
    def batch_activation_digits(self) -> int:
        return self._stack.batch_activation_digits()

    def start_profile(self, thread_clock: bool = False) -> None:
        """Sum the time of each part of the layers (norms, q/k/v, attention, ...) from now on, by the
        wall clock or the calling thread's CPU time (bench/kernels/decode.py reads it)."""
        self._stack.start_profile(thread_clock)

    def profile_seconds(self) -> dict[str, float]:
        """Seconds per part of the layers since `start_profile`, over every layer and call."""
        return dict(zip(self._stack.profile_parts(), self._stack.profile_seconds(), strict=True))

    def stop_profile(self) -> None:
        self._stack.stop_profile()

    def __call__(self, h: torch.Tensor, rope: Any, rows: Sequence[DecodeRows], write_blocks: Sequence[torch.Tensor],
                 write_offsets: torch.Tensor) -> torch.Tensor:
        """The residual stream after every layer (rows and write blocks per KV group), through the
        final norm when the stack applies it; each layer's new K/V are stored in their page slots,
        after it attends."""
        cos, sin = rope
        tables, starts, ends = [r.block_table for r in rows], [r.key_start for r in rows], [r.key_end for r in rows]
        if not self.tensor_parallel:
            return self._stack.forward(h, cos, sin, tables, starts, ends, list(write_blocks), write_offsets)
        write_blocks = list(write_blocks)
        if self._host is not None:
            return self._host.run_native(lambda exchange, sequence: self._stack.forward_ranked(
                h, cos, sin, tables, starts, ends, write_blocks, write_offsets, exchange, sequence),
                "an all-reduce")
        for index, (attention_reduce, mlp_reduce) in enumerate(self._all_reduces):
            h = h + attention_reduce(self._stack.attention_partial(index, h, cos, sin, tables, starts, ends,
                                                                   write_blocks, write_offsets))
            h = h + mlp_reduce(self._stack.mlp_partial(index, h))
        return h


def _shared_host_collectives(all_reduces: Sequence[tuple[AllReduce, AllReduce]]) -> Any:
    """The HostCollectives every layer's all-reduces go through, when they are one rank group's
    (`RankGroup.all_reduce`) on a shared segment whose all-reduce runs natively; else None."""
    owners = {id(getattr(reduce, "__self__", None)): getattr(reduce, "__self__", None)
              for pair in all_reduces for reduce in pair}
    if len(owners) != 1:
        return None
    host = getattr(next(iter(owners.values())), "host_collectives", None)
    return host if host is not None and host.native_exchange is not None else None


def native_final_norm(model: CausalLM) -> Optional[tuple[torch.Tensor, float]]:
    """(weight, eps) when the model's final norm is the Llama RMSNorm over float32 that the stack
    computes (`rms_norm` with the weight applied last); None for any other final norm."""
    if not isinstance(model, LlamaForCausalLM) or type(model).final_norm is not LlamaForCausalLM.final_norm:
        return None
    norm = model.norm
    if norm.dtype != torch.float32 or norm.dim() != 1:
        return None
    return norm.detach(), float(model.args.rms_norm_eps)


def _row_parallel_parts(module: torch.nn.Module) -> tuple[torch.nn.Module, Optional[AllReduce]]:
    """(the module a `RowParallel` wraps, its all-reduce), or (module, None) where not wrapped."""
    if isinstance(module, RowParallel):
        return module.inner, module.all_reduce
    return module, None


def _native_moe(moe: SparseMoE, experts: torch.nn.Module) -> Any:
    """The layer's experts (unwrapped from any `RowParallel`) with their router as one native
    object; ValueError when the kernel does not compute them (or the benchmark turned the native
    experts off)."""
    if not getattr(experts, "native_enabled", False):
        raise ValueError("the experts are not an `Experts` with the native path on")
    routing = getattr(moe.route, "native_routing", None)
    if routing is None:
        raise ValueError("a routing rule the kernel does not compute")
    return native_experts(experts, moe.router_weight, moe.router_bias, routing)


def _fuse(model: CausalLM, device: torch.device) -> tuple[Optional[list[FusedLlamaLayer]], Optional[str]]:
    """(one `FusedLlamaLayer` per layer, None), or (None, why not)."""
    if device.type != "cpu" or not cpu_kernels_available():
        return None, "the fused decoder layer is a native CPU kernel"
    layers = []
    for layer in model.layers:
        try:
            layers.append(FusedLlamaLayer.of(layer))
        except ValueError as exc:
            return None, f"layer {layer.layer_id}: {exc}"
    return layers, None


def unfusable_reason(model: CausalLM, device: torch.device) -> Optional[str]:
    """None when every layer of `model` can run as one native call; else why not."""
    return _fuse(model, device)[1]


def fused_layers(model: CausalLM, device: torch.device) -> Optional[Sequence[FusedLlamaLayer]]:
    """One `FusedLlamaLayer` per layer, or None when any layer cannot be fused."""
    return _fuse(model, device)[0]
