"""The batched Q4_1 products in integers across vector lanes (pdserve/kernels/q4_1_lanes.cpp): each
compiled lane width and digit count against a float64 model of its rounding, the batch-1 kernel's
rounding kept row for row, and greedy decoding of the embedded model unchanged by the batch."""

from __future__ import annotations

import pytest
import torch

from bench.kernels.q4_1 import compiled_lane_widths  # -march=native: 16 lanes with AVX-512 VNNI, and 8
from pdserve.kernels import native
from pdserve.models.quant.blocks import dequantize, quantize_q4_1
from tests.models.test_quantized_blocks import _block_offsets, _weights, require_native_kernels


def digits_reference(packed, x: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product with each block of 32 activations rounded to `digits` 7-bit digits, its error bound
    against the exact product), in float64: s = max|x| / (2^(7 digits) - 1) per block and row,
    y = (W - M) @ round(x / s) s + M @ x, |y - W @ x| <= |W - M| @ s / 2. The integers and s are
    taken in float32 as the kernel takes them (q = round(x * (int_max / max|x|))): at 15 and 22 bits
    float64's quotient would round some x / s to the other integer."""
    int_max = torch.tensor(2 ** (7 * digits) - 1, dtype=torch.float32)
    w = dequantize(packed).double()
    offsets = _block_offsets(packed).double()
    blocks = x.float().reshape(-1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, int_max / torch.where(largest > 0, largest, 1), 0)
    scale = (largest / int_max).double()
    rounded = (torch.round(blocks * inverse).double() * scale).reshape(x.shape)
    expected = rounded @ (w - offsets).t() + x.double() @ offsets.t()
    bound = (scale / 2).expand(-1, 32).reshape(x.shape) @ (w - offsets).abs().t()
    return expected, bound


def _activations(rows: int, in_features: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] *= 1e-3  # a block of small values keeps its own scale
    if rows > 2 and in_features > 32:
        x[2, 32:64] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("digits", [3, 2, 1])
@pytest.mark.parametrize("rows, out_features, in_features", [(16, 37, 96), (5, 24, 32), (17, 9, 576), (32, 40, 64)])
def test_lanes_match_the_float64_model_of_their_rounding(lanes, digits, rows, out_features, in_features):
    """Odd column counts (a partial column tile), a partial lane group, two groups. The tolerance is
    float32 summation's: a block's digit, scale or offset taken from its neighbour is off by ~1e-1."""
    require_native_kernels()
    if lanes not in compiled_lane_widths():
        pytest.skip(f"{lanes} lanes need AVX-512 VNNI")
    packed = quantize_q4_1(_weights(out_features, in_features, seed=rows + in_features))
    x = _activations(rows, in_features, seed=digits)
    got = native.ops().q4_1_linear_with(x, packed.blocks, lanes, digits).double()
    expected, bound = digits_reference(packed, x, digits)
    torch.testing.assert_close(got, expected, rtol=4e-6, atol=4e-6)
    exact = x.double() @ dequantize(packed).double().t()
    assert torch.all((got - exact).abs() <= bound + 4e-6)


@pytest.mark.parametrize("lanes", [16, 8])
def test_a_row_in_a_batch_is_rounded_as_the_one_row_kernel_rounds_it(lanes):
    """22-bit digits are the batch-1 kernel's integers: each row of a 16-row product equals that row
    alone up to the order of float sums (1e-6 of the outputs), far closer than the float tiles."""
    require_native_kernels()
    if lanes not in compiled_lane_widths():
        pytest.skip(f"{lanes} lanes need AVX-512 VNNI")
    ops = native.ops()
    packed = quantize_q4_1(_weights(96, 576, seed=11))
    x = _activations(16, 576, seed=12)
    batched = ops.q4_1_linear_with(x, packed.blocks, lanes, 3)
    alone = torch.cat([ops.q4_1_linear(x[r:r + 1], packed.blocks) for r in range(16)])
    scale = float(alone.abs().max())
    assert float((batched - alone).abs().max()) <= 2e-6 * scale
    float_tiles = ops.q4_1_linear_with(x, packed.blocks, 0, 3)
    torch.testing.assert_close(float_tiles, alone, rtol=1e-5, atol=1e-5 * scale)


def test_q4_1_linear_gives_16_rows_the_wide_lanes_and_keeps_few_rows_on_float_tiles():
    """16 rows: the 16 AVX-512 VNNI lanes where compiled (AVX2's 8 lanes lose to the float tiles)."""
    require_native_kernels()
    ops = native.ops()
    packed = quantize_q4_1(_weights(40, 128, seed=13))
    x = _activations(16, 128, seed=14)
    lanes = 16 if 16 in compiled_lane_widths() else 0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the lanes run on one thread only (measured slower than the tiles on two)
        assert torch.equal(ops.q4_1_linear(x, packed.blocks), ops.q4_1_linear_with(x, packed.blocks, lanes, 3))
        assert torch.equal(ops.q4_1_linear(x[:8], packed.blocks), ops.q4_1_linear_with(x[:8], packed.blocks, 0, 3))
        torch.set_num_threads(2)
        assert torch.equal(ops.q4_1_linear(x, packed.blocks), ops.q4_1_linear_with(x, packed.blocks, 0, 3))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("lanes", [16, 8])
def test_a_nan_or_an_infinity_reaches_every_output_of_its_row_only(lanes):
    require_native_kernels()
    if lanes not in compiled_lane_widths():
        pytest.skip(f"{lanes} lanes need AVX-512 VNNI")
    packed = quantize_q4_1(_weights(20, 96, seed=15))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = _activations(9, 96, seed=16)
        x[3, 70] = bad
        out = native.ops().q4_1_linear_with(x, packed.blocks, lanes, 3)
        assert not torch.isfinite(out[3]).any(), bad
        assert torch.isfinite(out[torch.arange(9) != 3]).all(), bad


def test_the_op_refuses_unknown_digits_lanes_and_shapes_with_an_error():
    require_native_kernels()
    ops = native.ops()
    blocks = quantize_q4_1(_weights(4, 64)).blocks
    with pytest.raises(RuntimeError, match="digits"):
        ops.q4_1_linear_with(torch.randn(8, 64), blocks, 8, 4)
    with pytest.raises(RuntimeError, match="lanes"):
        ops.q4_1_linear_with(torch.randn(8, 64), blocks, 12, 3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_1_linear_with(torch.randn(8, 48), blocks, 8, 3)


@pytest.mark.slow
def test_greedy_tokens_of_the_embedded_model_at_batch_16_equal_batch_1s():
    """As `pdserve serve` loads it (Q4_1 blocks, the fused layers): 16 prompts decoded together
    (the lanes) and one at a time (the one-row kernel) pick the same 32 tokens."""
    from pdserve.models.loader import load_model, resolve_quantization
    from tests.engine.harness import generate, generate_one_by_one, greedy, make_engine

    require_native_kernels()
    device = torch.device("cpu")
    loaded = load_model(None, torch.float32, device, resolve_quantization("auto", "auto", device))
    tokenizer = loaded.tokenizer
    topics = ["the sea", "gravity", "prime numbers", "Paris", "a cat", "rain", "the moon", "bread"]
    questions = [f"Write a short poem about {t}." for t in topics] + [f"Explain {t} to a child." for t in topics]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in questions]
    engine = make_engine(loaded=loaded, num_blocks=256, prefix_caching=False)
    sampling = greedy(32, ignore_eos=True)
    batched = [result.token_ids for result in generate(engine, prompts, sampling)]
    one_by_one = [result.token_ids for result in generate_one_by_one(engine, prompts, sampling)]
    assert batched == one_by_one
