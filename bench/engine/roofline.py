"""Machine ceilings for the engine benchmark, measured rather than quoted from a spec sheet.

c=1 decode streams every weight once per token, so its ceiling is read
bandwidth / weight bytes (fp32, or as stored when weights stay quantized); at
c=16 the same weights serve 16 tokens, so the ceiling is the FLOP/s of the model's own matmuls at M=16 over 2 * params.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from bench.engine.report import Roofline

_BANDWIDTH_BYTES = 1 << 30  # far larger than any cache, like the 0.5 GB of fp32 weights


def _best_time_s(fn: Callable[[], object], num_repeats: int) -> float:
    fn()  # first touch: page faults and allocator warm-up are not bandwidth
    best_s = float("inf")
    for _ in range(num_repeats):
        started_s = time.perf_counter()
        fn()
        best_s = min(best_s, time.perf_counter() - started_s)
    return best_s


def measure_read_bandwidth(num_repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum) of a 1 GiB fp32 tensor, best of `num_repeats`."""
    data = torch.ones(_BANDWIDTH_BYTES // 4, dtype=torch.float32)
    elapsed_s = _best_time_s(lambda: data.sum(), num_repeats)
    return _BANDWIDTH_BYTES / elapsed_s


def decode_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The matrices one decode step multiplies by, in forward order; the LM head counts even when
    tied to the embedding, because the step reads it in full (the embedding lookup reads one row)."""
    return [module.weight for module in model.modules() if isinstance(module, torch.nn.Linear)]


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every matmul weight plus the (tiny) norm weights."""
    matmul_bytes = sum(w.numel() * w.element_size() for w in decode_weights(model))
    norm_bytes = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("norm.weight")
    )
    return matmul_bytes + norm_bytes


def measure_matmul_flops(model: torch.nn.Module, num_rows: int, num_repeats: int = 5) -> float:
    """FLOP/s of one sweep over the model's matmul weights with `num_rows` tokens per matmul."""
    weights = decode_weights(model)
    inputs = {w.shape[1]: torch.randn(num_rows, w.shape[1], dtype=w.dtype) for w in weights}

    def sweep() -> None:
        with torch.inference_mode():
            for weight in weights:
                F.linear(inputs[weight.shape[1]], weight)

    elapsed_s = _best_time_s(sweep, num_repeats)
    num_params = sum(w.numel() for w in weights)
    return 2 * num_params * num_rows / elapsed_s


def measure_roofline(model: torch.nn.Module, concurrency: int, quantized_weight_bytes: int | None = None) -> Roofline:
    return Roofline(
        quantized_weight_bytes=quantized_weight_bytes,
        weight_bytes=decode_weight_bytes(model),
        read_bandwidth_bytes_per_s=measure_read_bandwidth(),
        matmul_params=sum(w.numel() for w in decode_weights(model)),
        matmul_concurrency=concurrency,
        matmul_flops_per_s=measure_matmul_flops(model, concurrency),
        matvec_flops_per_s=measure_matmul_flops(model, 1),
    )


def gguf_matmul_bytes(gguf_path: str) -> int:
    """Bytes of a GGUF's matmul weights as stored (quantized blocks), the output head included:
    what one decode step reads when the weights stay quantized."""
    import gguf

    from pdserve.models.gguf_reader import GGUFContainer

    total = 0
    for name, info in GGUFContainer(gguf_path).tensors.items():
        if len(info.dims) != 2:
            continue  # norms and other vectors
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        num_elements = 1
        for dim in info.dims:
            num_elements *= dim
        total += num_elements // block_size * type_size
    return total
