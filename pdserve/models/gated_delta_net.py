"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 and Qwen3-Next, over a flat batch.

Per value head the layer keeps a state S [key_dim, value_dim] that every token decays and corrects
(the gated delta rule; q and k are L2-normalised, q also scaled by key_dim ** -0.5):

    S <- exp(g_t) * S                      g_t = -exp(A_log) * softplus(a_t + dt_bias)  (<= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          beta_t = sigmoid(b_t)
    o_t = S^T q_t

A sequence with several rows in a pass runs the chunked form of that recurrence (exact up to
rounding: each chunk's corrections come from one unit-lower-triangular solve, then one state update
per chunk); sequences with a single row (decode) run one batched step. Invariant: the state written
back for a sequence is the one after its last row of the pass, whichever form computed it, and all
state arithmetic is float32.

Key heads are shared by `num_value_heads // num_key_heads` consecutive value heads. The fused input
projection's rows, and the channels of the short convolution (`short_conv.causal_conv`, then the
activation), are laid out as

    in_proj rows:  [ q: Hk*dk | k: Hk*dk | v: Hv*dv | z: Hv*dv | b: Hv | a: Hv ]
    conv channels: [ q | k | v ]   (the first 2*Hk*dk + Hv*dv rows)

and the output, normed per head and gated by SiLU(z), goes through `out_proj`. Under tensor
parallelism the shape is one rank's share of the heads and `load` cuts the whole tensors to it
(`state_sharding`); `out_proj` is then row parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.base import RecurrentStateContext
from pdserve.models.layers import rms_norm
from pdserve.models.short_conv import causal_conv
from pdserve.models.state_sharding import StateShard, cut_rows, refuse_state_split
from pdserve.models.weight_loader import WeightLoader
from pdserve.models.weight_targets import copy_rows, empty_linear, empty_param

SCAN_CHUNK_TOKENS = 64  # rows per chunk of the chunked scan (its triangular solves are this wide)
L2_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class GatedDeltaNetShape:
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_tokens: int

    @property
    def key_dim_total(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim_total(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim_total + self.value_dim_total

    @property
    def projection_rows(self) -> int:
        return self.conv_channels + self.value_dim_total + 2 * self.num_value_heads

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            kind="gated_delta_net", conv_channels=self.conv_channels, conv_window=self.conv_kernel_tokens - 1,
            recurrent_shape=(self.num_value_heads, self.key_head_dim, self.value_head_dim), dtype="float32",
            conv_parts=(self.key_dim_total, self.key_dim_total, self.value_dim_total))


def delta_net_rank_shape(shape: GatedDeltaNetShape, size: int) -> GatedDeltaNetShape:
    """One rank's share of the heads (its value heads are its key heads'); UnsupportedModelFeature
    when `size` does not divide the key heads."""
    refuse_state_split(size, "Gated DeltaNet", [("key heads", shape.num_key_heads),
                                                ("value heads", shape.num_value_heads)])
    return dataclasses.replace(shape, num_key_heads=shape.num_key_heads // size,
                               num_value_heads=shape.num_value_heads // size)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of each of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state
    [B, H, dk, dv] -> (output [B, H, dv], state after the row)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def _chunked(x: torch.Tensor, num_chunks: int, chunk_tokens: int) -> torch.Tensor:
    """[T, H, ...] -> [H, num_chunks, chunk_tokens, ...], zero rows padding the last chunk."""
    padding = num_chunks * chunk_tokens - x.shape[0]
    if padding:
        x = torch.cat([x, x.new_zeros((padding, *x.shape[1:]))])
    return x.reshape(num_chunks, chunk_tokens, *x.shape[1:]).movedim(2, 0)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """T rows of one sequence: q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [H, dk, dv] ->
    (output [T, H, dv], state after row T-1).

    Inside a chunk, with G_t the cumulative log decay from the chunk's start to row t and S0 the
    state before the chunk, each row writes u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t}
    exp(G_t - G_s) (k_t . k_s) u_s): a unit lower-triangular system in u, solved once for the v
    part and once for the part that reads S0. Then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t -
    G_s) (q_t . k_s) u_s and S_end = exp(G_end) S0 + sum_s exp(G_end - G_s) k_s u_s^T. Padding rows
    (k = 0, beta = 0, g = 0) change neither the outputs nor the state.
    """
    num_rows = q.shape[0]
    num_chunks = -(-num_rows // chunk_tokens)
    q, k, v, g, beta = (_chunked(x, num_chunks, chunk_tokens) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=q.device).tril()
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = system + torch.eye(chunk_tokens, dtype=system.dtype, device=system.device)
    written = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, (beta * log_decay.exp())[..., None] * k, upper=False,
                                          unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(v)
    for n in range(num_chunks):
        u = written[:, n] - reads[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + scores[:, n] @ u
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], num_chunks * chunk_tokens, -1)[:, :num_rows]
    return out.transpose(0, 1), state


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     sequence_starts: Sequence[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat batch's rows (q, k [rows, H, dk], v [rows, H, dv], g, beta [rows, H], float32) and every
    sequence's state [sequences, H, dk, dv] (updated in place) -> (output [rows, H, dv], the states)."""
    num_sequences = len(sequence_starts) - 1
    if q.shape[0] == num_sequences:  # decode: one row per sequence, one batched step
        out, new_state = delta_rule_step(q, k, v, g, beta, state)
        state.copy_(new_state)
        return out, state
    out = torch.empty_like(v)
    lengths = [sequence_starts[i + 1] - sequence_starts[i] for i in range(num_sequences)]
    single = [i for i in range(num_sequences) if lengths[i] == 1]
    if single:
        rows = torch.tensor([sequence_starts[i] for i in single], device=q.device)
        index = torch.tensor(single, device=q.device)
        out[rows], state[index] = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state[index])
    for i in range(num_sequences):
        if lengths[i] > 1:
            rows_of = slice(sequence_starts[i], sequence_starts[i + 1])
            out[rows_of], state[i] = delta_rule_chunked(q[rows_of], k[rows_of], v[rows_of], g[rows_of],
                                                        beta[rows_of], state[i])
    return out, state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a plain weight, then times SiLU(gate) in float32, cast back to x's dtype."""
    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(torch.nn.Module):
    """The mixer of one linear-attention layer: fused projection, short conv, the delta rule over each
    sequence's rows from its state, gated norm, output projection (see the module docstring)."""

    def __init__(self, shape: GatedDeltaNetShape, layer_id: int, hidden_size: int,
                 activation: Callable[[torch.Tensor], torch.Tensor], eps: float, dtype: torch.dtype,
                 device: torch.device, shard: Optional[StateShard] = None):
        super().__init__()
        self.shape, self.layer_id, self.activation, self.eps = shape, layer_id, activation, eps
        self.shard = shard  # None: the whole layer; else `shape` is this rank's share
        self.in_proj = empty_linear(hidden_size, shape.projection_rows, False, dtype)
        self.conv_weight = empty_param((shape.conv_channels, shape.conv_kernel_tokens), dtype, device)
        self.neg_decay_rate = empty_param((shape.num_value_heads,), torch.float32, device)  # -exp(A_log)
        self.dt_bias = empty_param((shape.num_value_heads,), torch.float32, device)
        self.norm_weight = empty_param((shape.value_head_dim,), dtype, device)
        self.out_proj = empty_linear(shape.value_dim_total, hidden_size, False, dtype)

    def whole_shape(self) -> GatedDeltaNetShape:
        """The whole layer's shape (this rank's share times the ranks)."""
        size = 1 if self.shard is None else self.shard.size
        return dataclasses.replace(self.shape, num_key_heads=self.shape.num_key_heads * size,
                                   num_value_heads=self.shape.num_value_heads * size)

    def forward(self, x: torch.Tensor, context: RecurrentStateContext) -> torch.Tensor:
        """x [rows, hidden] (normed residual stream) -> [rows, hidden]; reads and writes the layer's state."""
        shape, num_rows = self.shape, x.shape[0]
        starts = context.sequence_starts()
        conv_window, state = context.read_state(self.layer_id)
        mixed, z, b, a = self.in_proj(x).split(
            [shape.conv_channels, shape.value_dim_total, shape.num_value_heads, shape.num_value_heads], dim=-1)
        mixed, conv_window = causal_conv(mixed, starts, conv_window, self.conv_weight, None)
        q, k, v = self.activation(mixed).split([shape.key_dim_total, shape.key_dim_total, shape.value_dim_total], -1)
        heads_per_key = shape.num_value_heads // shape.num_key_heads
        q, k = (l2_normalize(t.reshape(num_rows, shape.num_key_heads, -1).float()) for t in (q, k))
        q, k = (t.repeat_interleave(heads_per_key, dim=1) for t in (q, k))
        q = q * shape.key_head_dim**-0.5
        v = v.reshape(num_rows, shape.num_value_heads, -1).float()
        beta = torch.sigmoid(b).float()
        g = self.neg_decay_rate * F.softplus(a.float() + self.dt_bias)
        out, state = gated_delta_rule(q, k, v, g, beta, starts, state.float())
        context.write_state(self.layer_id, conv_window, state)
        z = z.reshape(num_rows, shape.num_value_heads, -1)
        normed = gated_rms_norm(out.to(x.dtype), z, self.norm_weight, self.eps)
        return self.out_proj(normed.reshape(num_rows, -1))

    def load(self, weights: WeightLoader, prefix: str, projection_parts: Sequence[torch.Tensor]) -> None:
        """`projection_parts`: whole float row blocks q, k, v, z, b, a of the input projection (each family
        stores them its own way); the rest under `{prefix}` (`...linear_attn.`). A rank keeps its heads."""
        conv = weights.get(prefix + "conv1d.weight")  # [channels, 1, kernel]
        conv = conv.reshape(conv.shape[0], -1)
        A_log, dt_bias = weights.get(prefix + "A_log"), weights.get(prefix + "dt_bias")
        if self.shard is None:
            self.in_proj = weights.linear_from_tensors(self.in_proj, projection_parts, prefix + "in_proj")
            self.out_proj = weights.linear(self.out_proj, [prefix + "out_proj.weight"], prefix + "out_proj")
        else:
            key_rows, value_rows, value_heads = _rank_spans(self.shape, self.shard)
            self.in_proj = weights.linear_from_tensors(self.in_proj, cut_rows(
                projection_parts, [key_rows, key_rows, value_rows, value_rows, value_heads, value_heads]),
                prefix + "in_proj")
            out = weights.get(prefix + "out_proj.weight")[:, value_rows].contiguous()
            self.out_proj = weights.linear_from_tensors(self.out_proj, [out], prefix + "out_proj")
            whole = self.shape.num_key_heads * self.shard.size * self.shape.key_head_dim
            conv = torch.cat(cut_rows(conv.split([whole, whole, conv.shape[0] - 2 * whole]),
                                      [key_rows, key_rows, value_rows]))
            A_log, dt_bias = A_log[value_heads], dt_bias[value_heads]
        copy_rows(self.conv_weight, [conv], prefix + "conv1d")
        # A_log and dt_bias keep the checkpoint's precision in float32 (transformers rounds them to the model
        # dtype first: the same values in a float32 run, a last-bit difference at most in bf16).
        copy_rows(self.neg_decay_rate, [-A_log.float().exp()], prefix + "A_log")
        copy_rows(self.dt_bias, [dt_bias.float()], prefix + "dt_bias")
        copy_rows(self.norm_weight, [weights.get(prefix + "norm.weight")], prefix + "norm")


def _rank_spans(shape: GatedDeltaNetShape, shard: StateShard) -> tuple[slice, slice, slice]:
    """A rank's rows of a whole q (or k) block, of a whole v (or z) block, and its value heads; `shape`
    is the rank's share."""
    num_key_heads, num_value_heads = shape.num_key_heads * shard.size, shape.num_value_heads * shard.size
    return (shard.rows(num_key_heads, shape.key_head_dim), shard.rows(num_value_heads, shape.value_head_dim),
            shard.share(num_value_heads))
