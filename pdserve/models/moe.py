"""Mixture-of-experts feed-forward: a router picks top-k experts per token, the experts' outputs are
summed with the router's weights.

Tokens are grouped by expert before any matmul: the (token, expert) pairs of a step are sorted by
expert, and each expert that has tokens runs once over all of them (two matmuls, gate|up and
down), so a step costs one matmul pair per *active* expert, never one per token; an expert no
token chose is never read. Invariant: every token's output is the sum over its k experts of
weight * expert(token), added in ascending expert order (the order transformers adds them in).

    top-k ids  [[3, 0], [0, 2], [3, 1]]          3 tokens, k = 2
    sorted     expert 0: tokens 0, 1 | 1: token 2 | 2: token 1 | 3: tokens 0, 2
    matmuls    4 pairs (one per active expert), each over that expert's rows only

Expert weights are per-expert linear layers, so the float, int8 and int4 weight paths
(`WeightLoader`) serve them unchanged; checkpoints that store experts fused ([experts, ...] tensors,
MXFP4 blocks) are cut per expert at load by the model file, and MXFP4 and bfloat16 experts can
stay as they are (`Mxfp4Linear`, `Bfloat16Linear`: the native call reads them as it reads float32
rows, to the same bits). On a CPU with the native kernels and float32 activations, `Experts` runs
all of this in one native call (`moe_native.py`); the torch path here is its reference and its
fallback (other devices and dtypes, `torch.compile`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from pdserve.models.moe_native import native_experts
from pdserve.models.quant.mxfp4 import Mxfp4Weight, concat_output_rows
from pdserve.models.weight_targets import copy_rows, empty_linear, empty_param

if TYPE_CHECKING:
    from pdserve.models.weight_loader import WeightLoader

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [n, k] float, expert ids [n, k] int64)
GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> hidden


def softmax_then_top_k(logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """Qwen3-MoE: probabilities over all experts in float32, the k largest, optionally renormalised
    to sum to one (`norm_topk_prob`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def top_k_then_softmax(logits: torch.Tensor, k: int) -> Routing:
    """gpt-oss: the k largest logits, softmax over those k only."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


# Routing rules and activations as values, so that the native kernel can be told which one runs
# (`native_routing`: (top_k, rule), `native_activation`: (kind, alpha, limit), as moe_experts.h numbers them).

@dataclass(frozen=True, slots=True)
class TopKThenSoftmax:
    top_k: int

    def __call__(self, logits: torch.Tensor) -> Routing:
        return top_k_then_softmax(logits, self.top_k)

    @property
    def native_routing(self) -> tuple[int, int]:
        return self.top_k, 0


@dataclass(frozen=True, slots=True)
class SoftmaxThenTopK:
    top_k: int
    renormalize: bool

    def __call__(self, logits: torch.Tensor) -> Routing:
        return softmax_then_top_k(logits, self.top_k, self.renormalize)

    @property
    def native_routing(self) -> tuple[int, int]:
        return self.top_k, 2 if self.renormalize else 1


@dataclass(frozen=True, slots=True)
class SiluAndMul:
    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    @property
    def native_activation(self) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0


silu_and_mul = SiluAndMul()


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's SwiGLU: the gate clamped from above and the up projection on both sides at
    `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    @property
    def native_activation(self) -> tuple[float, float, float]:
        return 1.0, self.alpha, self.limit


def clamped_swiglu(alpha: float, limit: float) -> ClampedSwiGLU:
    return ClampedSwiGLU(alpha, limit)


def run_by_expert(x: torch.Tensor, routing: Routing, num_experts: int,
                  expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [n, hidden] and each token's (weights, expert ids) [n, k] -> [n, out]: `expert(e, rows)` runs
    once per active expert over the rows routed to it (see the module docstring)."""
    weights, ids = routing
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order within
    token_of_pair = order // k
    pair_weights = weights.reshape(-1)[order].unsqueeze(1)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # one host sync a layer
    out = torch.zeros_like(x)
    start = 0
    for index, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of_pair[start : start + count]
        y = expert(index, x[rows]) * pair_weights[start : start + count]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


ExpertMatrix = Union[torch.Tensor, Mxfp4Weight]


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One expert's weights in the checkpoint's orientation (rows = outputs): all three float
    tensors, or all three MXFP4."""

    gate: ExpertMatrix  # [intermediate, hidden]
    up: ExpertMatrix  # [intermediate, hidden]
    down: ExpertMatrix  # [hidden, intermediate]
    gate_bias: Optional[torch.Tensor] = None  # [intermediate]
    up_bias: Optional[torch.Tensor] = None
    down_bias: Optional[torch.Tensor] = None  # [hidden]

    def dequantized(self) -> "ExpertWeights":
        """The same expert with float32 matrices."""
        if not isinstance(self.gate, Mxfp4Weight):
            return self
        return replace(self, gate=self.gate.dequantize(), up=self.up.dequantize(), down=self.down.dequantize())


class Experts(torch.nn.Module):
    """`num_experts` gated MLPs, run over the tokens routed to each (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: GatedActivation,
                 bias: bool, dtype: torch.dtype):
        super().__init__()
        # False keeps the torch path (benchmarks compare the two); the native object is built on
        # first use after load, None until then, False where the kernel cannot compute these experts.
        self.native_enabled = True
        self._native: Any = None
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        # Per expert: gate rows then up rows in one matmul, then down.
        self.gate_up = torch.nn.ModuleList(
            empty_linear(hidden_size, 2 * intermediate_size, bias, dtype) for _ in range(num_experts))
        self.down = torch.nn.ModuleList(
            empty_linear(intermediate_size, hidden_size, bias, dtype) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [n, hidden] and each token's (weights, expert ids) [n, k] -> [n, hidden]."""
        native = self.native_object(x)
        if native is not None:
            return native.run_experts(x, *routing)
        return run_by_expert(x, routing, self.num_experts, self._expert)

    def native_object(self, x: torch.Tensor) -> Any:
        """The native experts (without a router) when they can run `x`, else None."""
        if (not self.native_enabled or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.compiler.is_compiling()):
            return None
        if self._native is None:
            try:
                self._native = native_experts(self)
            except ValueError:
                self._native = False
        return None if self._native is False else self._native

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[expert](x).split(self.intermediate_size, dim=-1)
        return self.down[expert](self.activation(gate, up))

    def load(self, weights: "WeightLoader", expert_weights: Callable[[int], ExpertWeights], prefix: str) -> None:
        """Fill every expert from `expert_weights(e)`: MXFP4 kept as it is, bfloat16 kept where the
        loader says so (`keeps_bfloat16`) and the kernel knows the activation, other float tensors
        float or quantized as the loader's policy says."""
        self._native = None  # rebuilt over the new weights on first use
        # bfloat16 rows pay only where the native experts widen them in registers; the torch path
        # would widen every expert on every call.
        native_activation = getattr(self.activation, "native_activation", None) is not None
        for e in range(self.num_experts):
            w = expert_weights(e)
            label = f"{prefix}experts.{e}"
            if isinstance(w.gate, Mxfp4Weight):
                self.gate_up[e] = weights.linear_from_mxfp4(self.gate_up[e], concat_output_rows([w.gate, w.up]),
                                                            label + ".gate_up")
                self.down[e] = weights.linear_from_mxfp4(self.down[e], w.down, label + ".down")
            elif native_activation and weights.keeps_bfloat16(self.gate_up[e], [w.gate, w.up, w.down]):
                self.gate_up[e] = weights.linear_from_bfloat16(self.gate_up[e], [w.gate, w.up], label + ".gate_up")
                self.down[e] = weights.linear_from_bfloat16(self.down[e], [w.down], label + ".down")
            else:
                self.gate_up[e] = weights.linear_from_tensors(self.gate_up[e], [w.gate, w.up], label + ".gate_up")
                self.down[e] = weights.linear_from_tensors(self.down[e], [w.down], label + ".down")
            if self.gate_up[e].bias is not None:
                copy_rows(self.gate_up[e].bias, [w.gate_bias, w.up_bias], label + ".gate_up bias")
                copy_rows(self.down[e].bias, [w.down_bias], label + ".down bias")


class SparseMoE(torch.nn.Module):
    """Router (a linear layer over the hidden state, optionally biased) plus experts."""

    def __init__(self, hidden_size: int, num_experts: int, route: Callable[[torch.Tensor], Routing],
                 experts: Experts, router_bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.route = route
        self.router_weight = empty_param((num_experts, hidden_size), dtype, device)
        self.router_bias = empty_param((num_experts,), dtype, device) if router_bias else None
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.route(F.linear(x, self.router_weight, self.router_bias)))

    def load_router(self, weight: torch.Tensor, bias: Optional[torch.Tensor], label: str) -> None:
        copy_rows(self.router_weight, [weight], label + " router")
        if self.router_bias is not None:
            copy_rows(self.router_bias, [bias], label + " router bias")
