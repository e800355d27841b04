"""The native single-row float32 product that `layers.linear` takes on the CPU, against BLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.native import ops
from pdserve.models.weight_targets import linear
from tests.models.test_quantized_blocks import require_native_kernels


@pytest.mark.parametrize("out_features, in_features", [(1, 32), (37, 96), (300, 64), (1000, 72)])
def test_one_row_matches_blas(out_features, in_features):
    """Odd widths too (72 is not a multiple of 32: the scalar tail)."""
    require_native_kernels()
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(1, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    torch.testing.assert_close(ops().f32_row_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_more_rows_and_non_contiguous_inputs_are_still_right():
    require_native_kernels()
    weight = torch.randn(64, 40).t()  # [40, 64], not contiguous
    x = torch.randn(3, 64)
    torch.testing.assert_close(ops().f32_row_linear(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops().f32_row_linear(x[1:2], weight), x[1:2] @ weight.t(), rtol=1e-5, atol=1e-5)
