"""The native mixture of experts (`pdserve_cpu::SparseMoeMlp`) against the torch path it replaces
(`pdserve.models.moe`): the same routing, the same expert outputs for float, int8 and int4
weights, with gpt-oss's biased clamped SwiGLU and Qwen3-MoE's SiLU, at one row and sixteen (with
several tokens on one expert); MXFP4 and bfloat16 experts bit for bit the float experts they
widen to; and the inputs it leaves to the torch path."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.moe import (
    ClampedSwiGLU, Experts, SoftmaxThenTopK, TopKThenSoftmax, run_by_expert, silu_and_mul,
)
from pdserve.models.moe_native import BFLOAT16_WEIGHT, MXFP4_WEIGHT, native_experts, native_weight
from pdserve.models.quant.modules import Bfloat16Linear, Mxfp4Linear
from pdserve.models.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4
from pdserve.models.weight_loader import WeightLoader, WeightPolicy
from tests.models.test_quantized_blocks import require_native_kernels

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 64, 32, 8, 3
CPU = torch.device("cpu")


class _NoSource:
    def has(self, name: str) -> bool:
        return False


def _experts(activation, bias: bool, quantization: str, seed: int, hidden: int = HIDDEN,
             width: int = WIDTH) -> Experts:
    experts = Experts(NUM_EXPERTS, hidden, width, activation, bias, torch.float32)
    loader = WeightLoader(_NoSource(), WeightPolicy.for_choice(quantization), CPU)
    generator = torch.Generator().manual_seed(seed)
    for e in range(NUM_EXPERTS):
        gate_up = torch.randn(2 * width, hidden, generator=generator) * 0.3
        down = torch.randn(hidden, width, generator=generator) * 0.3
        experts.gate_up[e] = loader.linear_from_tensors(experts.gate_up[e], [gate_up], "gate_up")
        experts.down[e] = loader.linear_from_tensors(experts.down[e], [down], "down")
        if bias:
            experts.gate_up[e].bias.copy_(torch.randn(2 * width, generator=generator))
            experts.down[e].bias.copy_(torch.randn(hidden, generator=generator))
    return experts


def _torch_reference(experts: Experts, x: torch.Tensor, routing) -> torch.Tensor:
    return run_by_expert(x, routing, experts.num_experts, experts._expert)


def _rows(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, HIDDEN, generator=generator) * 2, torch.randn(num_rows, NUM_EXPERTS, generator=generator)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("activation, bias", [(ClampedSwiGLU(1.702, 7.0), True), (silu_and_mul, False)])
@pytest.mark.parametrize("num_rows", [1, 16])
def test_native_experts_match_the_torch_path(quantization, activation, bias, num_rows):
    require_native_kernels()
    experts = _experts(activation, bias, quantization, seed=num_rows)
    x, logits = _rows(num_rows, seed=7)
    routing = TopKThenSoftmax(TOP_K)(logits)
    if num_rows > 1:  # many tokens on one expert, and one expert nobody chose
        ids = routing[1]
        ids[: num_rows // 2, 0] = 2
        ids[ids == 5] = 4
        routing = (routing[0], ids)
    with torch.inference_mode():
        expected = _torch_reference(experts, x, routing)
        assert experts.native_object(x) is not None
        got = experts(x, routing)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden, width", [(36, 13), (64, 32)])
def test_float_experts_of_any_width_match_the_torch_path_at_every_row_count(hidden, width):
    """The float kernel's edges: widths that are no multiple of 8 (a product's columns) or of 4 (its
    weight rows), and 1 to 9 rows on one expert (token rows go four at a time)."""
    require_native_kernels()
    experts = _experts(ClampedSwiGLU(1.702, 7.0), True, "none", seed=hidden, hidden=hidden, width=width)
    native = native_experts(experts)
    generator = torch.Generator().manual_seed(width)
    for num_rows in range(1, 10):
        x = torch.randn(num_rows, hidden, generator=generator)
        ids = torch.stack([torch.full((num_rows,), 1), torch.arange(num_rows) % 2 * 4 + 2], dim=1)  # 1, then 2 or 6
        weights = torch.softmax(torch.randn(num_rows, 2, generator=generator), dim=-1)
        with torch.inference_mode():
            expected = _torch_reference(experts, x, (weights, ids))
        torch.testing.assert_close(native.run_experts(x, weights, ids), expected, rtol=1e-5, atol=1e-5)


def _mxfp4_experts(activation, bias: bool, seed: int, hidden: int, width: int) -> tuple[Experts, Experts]:
    """(experts kept in MXFP4, the same experts as their dequantized float32 weights)."""
    mxfp4 = _experts(activation, bias, "none", seed, hidden, width)
    floats = _experts(activation, bias, "none", seed, hidden, width)
    loader = WeightLoader(_NoSource(), WeightPolicy(), CPU)
    for e in range(NUM_EXPERTS):
        for kept, plain in ((mxfp4.gate_up, floats.gate_up), (mxfp4.down, floats.down)):
            blocks, scales = quantize_mxfp4(plain[e].weight.detach())
            scales[0, 0] = 0  # the smallest scale, 2^-127 (subnormal products)
            packed = Mxfp4Weight.from_blocks(blocks, scales)
            bias_values = None if plain[e].bias is None else plain[e].bias.detach().clone()
            kept[e] = loader.linear_from_mxfp4(kept[e], packed, "expert")
            if bias_values is not None:
                kept[e].bias.copy_(bias_values)
            plain[e].weight.data.copy_(packed.dequantize())
    return mxfp4, floats


@pytest.mark.parametrize("activation, bias", [(ClampedSwiGLU(1.702, 7.0), True), (silu_and_mul, False)])
@pytest.mark.parametrize("hidden, width", [(64, 32), (96, 64)])
def test_mxfp4_experts_give_the_float_experts_bits_at_every_row_count(activation, bias, hidden, width):
    """The MXFP4 kernel decodes each weight exactly and adds in the float kernel's order: outputs are
    equal bit for bit, from 1 to 19 rows on one expert (token rows go four at a time); and both
    agree with the torch path (which dequantizes per call)."""
    require_native_kernels()
    mxfp4, floats = _mxfp4_experts(activation, bias, seed=hidden, hidden=hidden, width=width)
    assert isinstance(mxfp4.gate_up[0], Mxfp4Linear) and native_weight(mxfp4.down[0])[1] == MXFP4_WEIGHT
    _assert_same_bits_as_float(mxfp4, floats, hidden, (1, 2, 3, 5, 8, 19), seed=width, scale=2.0)


def _assert_same_bits_as_float(kept_experts: Experts, floats: Experts, hidden: int, row_counts, seed: int,
                               scale: float = 1.0) -> None:
    """The native kept experts give the native float experts' outputs bit for bit at each row count
    (rows on experts 1 and 2, 4 or 6), and agree with the torch path (BLAS adds in another order)."""
    kept, plain = native_experts(kept_experts), native_experts(floats)
    generator = torch.Generator().manual_seed(seed)
    for num_rows in row_counts:
        x = torch.randn(num_rows, hidden, generator=generator) * scale
        ids = torch.stack([torch.full((num_rows,), 1), torch.arange(num_rows) % 3 * 2 + 2], dim=1)
        weights = torch.softmax(torch.randn(num_rows, 2, generator=generator), dim=-1)
        got = kept.run_experts(x, weights, ids)
        assert torch.equal(got, plain.run_experts(x, weights, ids)), f"{num_rows} rows"
        with torch.inference_mode():
            expected = _torch_reference(kept_experts, x, (weights, ids))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hidden, width", [(64, 32), (36, 13)])
def test_bfloat16_experts_give_the_float_experts_bits_at_every_row_count(hidden, width):
    """Rows kept in bfloat16 widen exactly in registers: the float kernel's bits, widths that are no
    multiple of 8 included (their tails widen one by one)."""
    require_native_kernels()
    kept_experts = _experts(ClampedSwiGLU(1.702, 7.0), True, "none", seed=width, hidden=hidden, width=width)
    floats = _experts(ClampedSwiGLU(1.702, 7.0), True, "none", seed=width, hidden=hidden, width=width)
    loader = WeightLoader(_NoSource(), WeightPolicy(), CPU)
    for e in range(NUM_EXPERTS):
        for kept, plain in ((kept_experts.gate_up, floats.gate_up), (kept_experts.down, floats.down)):
            rows = plain[e].weight.detach().to(torch.bfloat16)
            bias = plain[e].bias.detach().clone()
            kept[e] = loader.linear_from_bfloat16(kept[e], [rows], "expert")
            kept[e].bias.copy_(bias)
            plain[e].weight.data.copy_(rows.float())
    assert isinstance(kept_experts.down[0], Bfloat16Linear)
    assert native_weight(kept_experts.down[0])[1] == BFLOAT16_WEIGHT
    _assert_same_bits_as_float(kept_experts, floats, hidden, (1, 3, 5, 19), seed=hidden)


def test_the_kernel_refuses_mxfp4_widths_that_split_a_group():
    require_native_kernels()
    mxfp4, _ = _mxfp4_experts(silu_and_mul, False, seed=1, hidden=64, width=32)
    rows = [linear.rows for linear in mxfp4.gate_up]
    with pytest.raises(RuntimeError, match="gate|up must be"):
        torch.classes.pdserve_cpu.SparseMoeMlp(torch.empty(0), torch.empty(0), rows, [r[:, :-1] for r in rows],
                                               MXFP4_WEIGHT, torch.empty(0), torch.empty(0), [1, 0], [0.0, 0.0, 0.0])


def test_the_clamp_and_the_gate_limit_are_applied():
    """Large activations hit gpt-oss's clamps: the native path clamps where torch does."""
    require_native_kernels()
    experts = _experts(ClampedSwiGLU(1.702, 0.5), True, "none", seed=3)
    x, logits = _rows(4, seed=9)
    routing = TopKThenSoftmax(TOP_K)(logits)
    with torch.inference_mode():
        expected = _torch_reference(experts, x * 20, routing)
        got = experts(x * 20, routing)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rule", [TopKThenSoftmax(TOP_K), SoftmaxThenTopK(TOP_K, False), SoftmaxThenTopK(TOP_K, True)])
def test_native_routing_matches_the_rules(rule):
    require_native_kernels()
    experts = _experts(silu_and_mul, False, "none", seed=1)
    generator = torch.Generator().manual_seed(11)
    router_weight = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    router_bias = torch.randn(NUM_EXPERTS, generator=generator)
    native = native_experts(experts, router_weight, router_bias, rule.native_routing)
    x, _ = _rows(16, seed=5)
    expected_weights, expected_ids = rule(torch.nn.functional.linear(x, router_weight, router_bias))
    weights, ids = native.route(x)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        expected = _torch_reference(experts, x, (expected_weights, expected_ids))
    # Outputs reach ~20 here: float32's rounding order differs between BLAS and the row kernels.
    torch.testing.assert_close(native.forward(x), expected, rtol=1e-4, atol=1e-4)


def test_other_dtypes_and_a_disabled_native_path_take_the_torch_path():
    require_native_kernels()
    experts = _experts(silu_and_mul, False, "none", seed=2)
    x, logits = _rows(2, seed=3)
    assert experts.native_object(x.bfloat16()) is None
    experts.native_enabled = False
    assert experts.native_object(x) is None
    routing = TopKThenSoftmax(TOP_K)(logits)
    torch.testing.assert_close(experts(x, routing), _torch_reference(experts, x, routing))


def test_an_activation_the_kernel_does_not_know_keeps_the_torch_path():
    require_native_kernels()
    experts = _experts(lambda gate, up: torch.tanh(gate) * up, False, "none", seed=4)
    x, _ = _rows(1, seed=1)
    assert experts.native_object(x) is None
    with pytest.raises(ValueError, match="activation"):
        native_experts(experts)


def test_the_kernel_rejects_an_expert_id_out_of_range():
    require_native_kernels()
    native = native_experts(_experts(silu_and_mul, False, "none", seed=5))
    x, _ = _rows(2, seed=2)
    ids = torch.tensor([[0, 1, NUM_EXPERTS], [0, 1, 2]])
    with pytest.raises(RuntimeError, match="out of range"):
        native.run_experts(x, torch.ones(2, 3), ids)
