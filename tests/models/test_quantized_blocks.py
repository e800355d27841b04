"""Block formats and the native kernels that multiply them: every path against a dequantized
reference, and our reading of GGUF's formats against the `gguf` package's own dequantizer."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.models.gguf_file import GGUFCheckpoint
from pdserve.models.loader import embedded_model_path
from pdserve.models.quant.blocks import (
    BlockFormat, PackedWeight, concat_rows, dequantize, q4_0_as_q4_1, quantize_q4_1, quantize_q8_0,
)
from pdserve.models.quant.modules import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf")


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * 0.05


def _gguf_packed(weight: torch.Tensor, qtype) -> np.ndarray:
    return gguf.quants.quantize(weight.numpy(), qtype)


ROW_INT_MAX = 2**21 - 1  # the one-row Q4_1 kernel's activation integers: 22 bits


def _block_offsets(packed: PackedWeight) -> torch.Tensor:
    """Each Q4_1 weight's block offset m, [out_features, in_features]."""
    blocks = packed.blocks.reshape(packed.out_features, -1, packed.format.block_bytes)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return m.repeat_interleave(32, dim=1)


def one_row_q4_1_reference(packed: PackedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the one-row Q4_1 kernel computes, its error bound against the exact product), in float64.

    The kernel rounds each block of 32 activations to 22-bit integers on the scale
    s = max|x| / (2^21 - 1) and multiplies those with the codes d * q, while the offsets m meet
    the exact activations: y = (W - M) @ round(x / s) s + M @ x; and |y - W @ x| <= |W - M| @ s / 2."""
    w = dequantize(packed).double()
    offsets = _block_offsets(packed).double()
    blocks = x.double().reshape(-1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / ROW_INT_MAX
    rounded = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale, 0).reshape(x.shape)
    expected = rounded @ (w - offsets).t() + x.double() @ offsets.t()
    bound = (scale / 2).expand(-1, 32).reshape(x.shape) @ (w - offsets).abs().t()
    return expected, bound


def require_native_kernels() -> None:
    """Skip only where the CPU cannot run them; a failed build on a capable CPU is a failure."""
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in native._cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    if shutil.which(native._compiler()) is None:
        pytest.skip(f"no C++ compiler ({native._compiler()}) to build the kernels with")
    assert native.cpu_kernels_error() is None


@pytest.mark.parametrize("qtype, ours", [("Q4_1", BlockFormat.Q4_1), ("Q8_0", BlockFormat.Q8_0)])
def test_our_reading_of_gguf_blocks_matches_the_gguf_dequantizer(qtype, ours):
    weight = _weights(8, 96)
    raw = _gguf_packed(weight, gguf.GGMLQuantizationType[qtype])
    packed = PackedWeight(torch.from_numpy(raw.copy()), ours, 96)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(8, 96)
    torch.testing.assert_close(dequantize(packed), torch.from_numpy(expected), rtol=0, atol=0)


def test_q4_0_is_rewritten_as_q4_1_exactly():
    weight = _weights(6, 64, seed=1)
    raw = _gguf_packed(weight, gguf.GGMLQuantizationType.Q4_0)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).reshape(6, 64)
    packed = q4_0_as_q4_1(torch.from_numpy(raw.copy()), 64)
    assert packed.format is BlockFormat.Q4_1 and packed.blocks.shape == (6, 2 * 20)
    torch.testing.assert_close(dequantize(packed), torch.from_numpy(expected), rtol=0, atol=0)


@pytest.mark.parametrize("quantize, levels", [(quantize_q4_1, 15), (quantize_q8_0, 254)])
def test_quantizers_stay_within_half_a_step_of_each_block(quantize, levels):
    weight = _weights(16, 128, seed=2)
    restored = dequantize(quantize(weight))
    groups = weight.reshape(16, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / levels if levels == 15 else groups.abs().amax(-1) * 2 / levels
    error = (restored - weight).abs().reshape(16, 4, 32).amax(-1)
    assert torch.all(error <= step * 0.52 + 1e-6)  # half a step, plus the half-float rounding of d and m


def test_fused_rows_keep_each_part_in_order():
    parts = [quantize_q8_0(_weights(rows, 64, seed=rows)) for rows in (3, 5)]
    fused = concat_rows(parts)
    torch.testing.assert_close(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    with pytest.raises(ValueError):
        concat_rows([parts[0], quantize_q4_1(_weights(2, 64))])


def test_embedded_gguf_packed_tensors_are_the_dequantized_ones_row_for_row():
    """Including llama.cpp's Q/K row interleave, which get_packed must undo on the blocks."""
    checkpoint = GGUFCheckpoint(embedded_model_path())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):
        packed = checkpoint.get_packed(name)
        assert packed is not None, name
        torch.testing.assert_close(dequantize(packed), checkpoint.get(name), rtol=0, atol=0)
    assert checkpoint.get_packed("model.layers.0.input_layernorm.weight") is None  # F32 stays float


@pytest.mark.parametrize("make", [quantize_q4_1, quantize_q8_0])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 40])  # every row tile, and the dequantize + BLAS path
def test_native_linear_matches_the_dequantized_reference(make, rows):
    require_native_kernels()
    packed = make(_weights(72, 160, seed=rows))
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    layer = QuantizedLinear(packed, bias=torch.nn.Parameter(torch.randn(72), requires_grad=False))
    assert layer.native
    expected = F.linear(x, dequantize(packed), layer.bias)
    if rows == 1 and packed.format is BlockFormat.Q4_1:  # 22-bit activations: see one_row_q4_1_reference
        integer_expected, bound = one_row_q4_1_reference(packed, x)
        torch.testing.assert_close(layer(x).double(), integer_expected + layer.bias.double(), rtol=1e-5, atol=1e-5)
        assert torch.all((layer(x) - expected).abs() <= bound + 1e-5)
        expected = (integer_expected + layer.bias.double()).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.reshape(rows, 1, 160)), expected.reshape(rows, 1, 72), rtol=1e-5, atol=1e-5)


def _from_gguf(raw: np.ndarray, qtype: str, in_features: int) -> PackedWeight:
    blocks = torch.from_numpy(raw.copy())
    if qtype == "Q4_0":
        return q4_0_as_q4_1(blocks, in_features)
    return PackedWeight(blocks, BlockFormat[qtype], in_features)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, out_features, in_features",
                         [(1, 37, 96), (3, 37, 224), (7, 13, 32), (33, 41, 64), (19, 17, 64), (65, 9, 96)])
def test_native_linear_on_gguf_blocks_matches_torch_dequantize_and_matmul(qtype, rows, out_features, in_features):
    """Blocks packed by the `gguf` package, odd output widths (no full row tile), odd batch sizes
    (a 16-row tile and a rest; past 64 rows the dequantized matmul): the native kernel against the
    `gguf` package's own dequantizer followed by a torch matmul."""
    require_native_kernels()
    weight = _weights(out_features, in_features, seed=out_features + rows)
    raw = _gguf_packed(weight, gguf.GGMLQuantizationType[qtype])
    reference_weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(out_features, in_features)
    layer = QuantizedLinear(_from_gguf(raw, qtype, in_features))
    assert layer.native
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    expected = x @ torch.from_numpy(reference_weight).T
    if rows == 1 and layer.format is BlockFormat.Q4_1:  # Q4_0 too: it is served as Q4_1
        integer_expected, bound = one_row_q4_1_reference(layer.packed, x)
        torch.testing.assert_close(layer(x).double(), integer_expected, rtol=1e-5, atol=1e-5)
        assert torch.all((layer(x) - expected).abs() <= bound + 1e-5)
        return
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_features", [32, 64, 96, 576])  # one block, one pair, a pair and a half, 18 blocks
def test_one_row_q4_1_rounds_activations_as_documented_and_keeps_non_finite_values(in_features):
    """The one-row Q4_1 kernel against the float64 model of its 22-bit activations (odd block
    counts pair the last block with itself), zero blocks included; then a NaN or an infinity
    in the row must reach every output, as it would in a float product."""
    require_native_kernels()
    packed = quantize_q4_1(_weights(50, in_features, seed=in_features))
    layer = QuantizedLinear(packed)
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(3)) * 4
    x[0, :32] *= 1e-3  # a block of small values keeps its own scale
    if in_features > 32:
        x[0, 32:64] = 0  # an all-zero block
    expected, bound = one_row_q4_1_reference(packed, x)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-6)
    exact = x.double() @ dequantize(packed).double().t()
    error = (layer(x).double() - exact).abs()
    assert torch.all(error <= bound + 1e-5)
    assert float(bound.max()) < 1e-4 * float(exact.abs().max())  # the bound says something
    assert float(error.max()) < 1e-5 * float(exact.abs().max())  # float32-sized, like a float kernel's
    for bad in (float("nan"), float("inf")):
        poisoned = x.clone()
        poisoned[0, in_features - 1] = bad
        assert not torch.isfinite(layer(poisoned)).any()


def test_torch_fallback_linear_and_embedding_match_the_native_ones():
    require_native_kernels()
    packed = quantize_q4_1(_weights(40, 96, seed=7))
    fallback = QuantizedLinear(packed)
    fallback.native = False  # what another device or a CPU without the kernels runs
    x = torch.randn(3, 96)
    torch.testing.assert_close(fallback(x), QuantizedLinear(packed)(x), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 39], [5, 5]])
    embedding, reference = QuantizedEmbedding(packed, torch.float32), QuantizedEmbedding(packed, torch.float32)
    reference.native = False
    torch.testing.assert_close(embedding(ids), dequantize(packed)[ids], rtol=0, atol=0)
    torch.testing.assert_close(reference(ids), dequantize(packed)[ids], rtol=0, atol=0)


def test_native_ops_reject_bad_shapes_with_an_error_not_a_crash():
    require_native_kernels()
    ops = native.ops()
    blocks = quantize_q8_0(_weights(4, 64)).blocks
    with pytest.raises(RuntimeError, match="multiple of 32|do not match"):
        ops.q8_0_linear(torch.randn(2, 48), blocks)
    with pytest.raises(RuntimeError, match="float32"):
        ops.q8_0_linear(torch.randn(2, 64, dtype=torch.float64), blocks)


def test_auto_quantization_keeps_gguf_blocks_on_the_cpu_except_in_the_exact_mode():
    from pdserve.models.loader import resolve_quantization

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", "auto", cpu) == "gguf"
    assert resolve_quantization("auto", "float32", cpu) == "none"  # what parity tests use
    assert resolve_quantization("auto", "auto", cuda) == "none"
    assert resolve_quantization("int4", "float32", cpu) == "int4"
    with pytest.raises(ValueError):
        resolve_quantization("int3", "auto", cpu)


def test_cli_quantization_and_compile_flags_reach_the_model_config():
    from pdserve.app.cli import build_parser, worker_config

    args = build_parser().parse_args(["serve", "--quantization", "int8", "--no-compile"])
    model = worker_config(args, "colocated").model
    assert (model.quantization, model.compile) == ("int8", False)
    defaults = worker_config(build_parser().parse_args(["serve"]), "colocated").model
    assert (defaults.quantization, defaults.compile) == ("auto", None)


@pytest.mark.parametrize("choice, head_format, min_cosine", [("int8", "q8_0", 0.999), ("int4", "q8_0", 0.97)])
def test_float_checkpoints_are_quantized_at_load(tmp_path, choice, head_format, min_cosine):
    from pdserve.models.loader import load_model
    from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
    from tests.tiny_models import QWEN_VOCAB, make_tiny_qwen3, random_prompt

    make_tiny_qwen3(str(tmp_path))
    exact = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    quantized = load_model(str(tmp_path), torch.float32, torch.device("cpu"), quantization=choice)
    layer = quantized.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(linear, QuantizedLinear) for linear in linears)
    assert linears[0].format.label == ("q8_0" if choice == "int8" else "q4_1")
    assert quantized.model.lm_head.format.label == head_format  # output heads keep 8 bits
    prompt = random_prompt(24, QWEN_VOCAB, 3)
    ours = forward_chunk(quantized.model, ContiguousAttention(quantized.model.spec.layer_specs), "s", prompt)
    reference = forward_chunk(exact.model, ContiguousAttention(exact.model.spec.layer_specs), "s", prompt)
    assert F.cosine_similarity(ours, reference, dim=-1).min() > min_cosine
