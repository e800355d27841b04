"""Rotary position embeddings: inverse frequencies per rope type, and the
precomputed cos/sin table every layer indexes by position.

The table is computed once in float32 exactly as the reference does
(position * inv_freq, then cos/sin, times the attention scaling) and only then
cast to the model dtype, so fp32 runs match transformers bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from pdserve.models.hf_config import UnsupportedModelFeature


def inverse_frequencies(rope: Mapping[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention scaling) for a standardized rope dict."""
    theta = float(rope["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn(theta, rotary_dim, rope)
    if rope_type == "freq_factors":
        # llama.cpp stores Llama 3.1 style scaling as per-frequency divisors (the `rope_freqs` tensor).
        factors = torch.tensor(rope["factors"], dtype=torch.float32)
        return inv_freq / factors, 1.0
    raise UnsupportedModelFeature(f"rope type {rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend in between."""
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(theta: float, dim: int, rope: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, with a linear ramp between."""
    factor = float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryTable(torch.nn.Module):
    """cos/sin of every position up to `max_positions`, half a head wide.

    Rotation uses the split-halves convention of Hugging Face checkpoints:
    x = [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin].
    """

    def __init__(
        self,
        rope: Mapping[str, Any],
        rotary_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(rope, rotary_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.register_buffer("cos", (angles.cos() * scaling).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * scaling).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [num_tokens, 1, rotary_dim // 2], broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by per-token angles. With partial rotary embeddings
    (a table built for rotary_dim < head_dim: Qwen3.5, Qwen3-Next) only the first rotary_dim dims
    rotate and the rest pass unchanged."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
