"""The one-row Q4_1 products in integers (pdserve/kernels/q4_1_row.cpp, four blocks a 512-bit vector
where AVX-512 VNNI and VBMI are compiled; quantized_matmul.cpp's 256-bit kernel): each against a
float64 model of its rounding, the two against each other, and q4_1_linear's choice at batch 1."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import native
from pdserve.models.quant.blocks import dequantize, quantize_q4_1
from tests.models.test_q4_1_lanes import _activations, digits_reference
from tests.models.test_quantized_blocks import _weights, require_native_kernels


def compiled_row_widths() -> list[int]:
    flags = native._cpu_flags()
    return ([512] if {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= flags else []) + [256]


# k / 32 = 1, 3, 5, 18 and 48 blocks: a quad's 1-3 block tail, none, and the model's widths.
SHAPES = [(37, 32), (9, 96), (24, 160), (40, 576), (33, 1536)]


@pytest.mark.parametrize("width", [512, 256])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_each_width_matches_the_float64_model_of_its_22_bit_rounding(width, out_features, in_features):
    require_native_kernels()
    if width not in compiled_row_widths():
        pytest.skip(f"{width}-bit one-row products need AVX-512 VNNI and VBMI")
    packed = quantize_q4_1(_weights(out_features, in_features, seed=in_features))
    x = _activations(1, in_features, seed=out_features)
    got = native.ops().q4_1_row_linear_with(x, packed.blocks, width).double()
    expected, bound = digits_reference(packed, x, 3)
    torch.testing.assert_close(got, expected, rtol=4e-6, atol=4e-6)
    exact = x.double() @ dequantize(packed).double().t()
    assert torch.all((got - exact).abs() <= bound + 4e-6)


def test_the_widths_agree_up_to_the_order_of_float_sums_and_q4_1_linear_takes_the_widest():
    """The same integers in both: 1e-6 of the outputs apart; a block that reads its neighbour's
    digits or scale, or a tail block reading the next weight row, would be ~1e-1 off."""
    require_native_kernels()
    ops = native.ops()
    widths = compiled_row_widths()
    for out_features, in_features in SHAPES:
        packed = quantize_q4_1(_weights(out_features, in_features, seed=in_features + 1))
        x = _activations(1, in_features, seed=in_features)
        by_width = {width: ops.q4_1_row_linear_with(x, packed.blocks, width) for width in widths}
        scale = float(by_width[256].abs().max())
        for width in widths:
            assert float((by_width[width] - by_width[256]).abs().max()) <= 2e-6 * scale, (width, in_features)
        assert torch.equal(ops.q4_1_linear(x, packed.blocks), by_width[widths[0]])


@pytest.mark.parametrize("width", [512, 256])
def test_a_nan_or_an_infinity_in_the_row_reaches_every_output(width):
    require_native_kernels()
    if width not in compiled_row_widths():
        pytest.skip(f"{width}-bit one-row products need AVX-512 VNNI and VBMI")
    packed = quantize_q4_1(_weights(20, 160, seed=17))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = _activations(1, 160, seed=18)
        x[0, 130] = bad  # in the tail block after the first quad
        out = native.ops().q4_1_row_linear_with(x, packed.blocks, width)
        assert not torch.isfinite(out).any(), bad


def test_the_op_refuses_an_unknown_width_and_more_than_one_row_with_an_error():
    require_native_kernels()
    ops = native.ops()
    blocks = quantize_q4_1(_weights(4, 64)).blocks
    with pytest.raises(RuntimeError, match="not compiled"):
        ops.q4_1_row_linear_with(torch.randn(1, 64), blocks, 128)
    with pytest.raises(RuntimeError, match="one float32 row"):
        ops.q4_1_row_linear_with(torch.randn(2, 64), blocks, 256)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_1_row_linear_with(torch.randn(1, 48), blocks, 256)
