"""Q4_1 weights in one-row tiles (pdserve/kernels/q4_1_row_tiles.cpp): the layout its diagram draws,
each row's products bit for bit those of the blocks' own one-row kernel on that row alone (odd
block counts, NaN, infinity, zero and huge blocks, several rows), and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import native
from pdserve.models.quant.blocks import quantize_q4_1
from tests.models.test_quantized_blocks import _weights, require_native_kernels

TILE_ROWS, PAIR_BYTES = 16, 640


def _require_tiles():
    require_native_kernels()
    if not native.ops().q4_1_row_tiles_supported():
        pytest.skip("one-row tiles need AVX-512 VNNI")


def _rows(k: int, seed: int) -> list[torch.Tensor]:
    """Activation rows that exercise each branch of the rounding."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for case in range(6):
        x = torch.randn(1, k, generator=generator) * 10.0 ** (case - 3)
        if case == 1:
            x[0, 3] = float("nan")
        elif case == 2:
            x[0, k - 1] = float("inf")
        elif case == 3:
            x[0, :32] = 0
        elif case == 4:
            x[0, :16] = -1e30
        rows.append(x)
    return rows


@pytest.mark.parametrize("out_features, in_features", [(16, 32), (32, 96), (48, 576), (16, 1536), (64, 160)])
def test_tiles_give_the_blocks_one_row_kernels_bits(out_features, in_features):
    """One block (a pair with itself), odd block counts (3, 5), the embedded model's widths."""
    _require_tiles()
    blocks = quantize_q4_1(_weights(out_features, in_features, seed=in_features)).blocks
    tiles = native.ops().q4_1_row_tiles(blocks)
    assert tiles.shape == (out_features // TILE_ROWS, (in_features // 32 + 1) // 2 * PAIR_BYTES)
    for x in _rows(in_features, seed=out_features):
        expected = native.ops().q4_1_linear(x, blocks)
        got = native.ops().q4_1_tiled_linear(x, tiles)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    finite = _rows(in_features, seed=0)[0]
    assert torch.isfinite(native.ops().q4_1_tiled_linear(finite, tiles)).all()


def test_each_row_of_several_gets_its_own_one_row_bits():
    """Rows multiplied together give what each gives alone (the float row tiles do not)."""
    _require_tiles()
    blocks = quantize_q4_1(_weights(48, 160, seed=9)).blocks
    tiles = native.ops().q4_1_row_tiles(blocks)
    x = torch.cat(_rows(160, seed=4)[:3] + [torch.zeros(1, 160)])
    together = native.ops().q4_1_tiled_linear(x, tiles)
    assert together.shape == (4, 48)
    for r in range(4):
        alone = native.ops().q4_1_linear(x[r:r + 1], blocks)
        assert torch.equal(together[r:r + 1].view(torch.int32), alone.view(torch.int32))
    assert native.ops().q4_1_tiled_linear(x[:0], tiles).shape == (0, 48)


def test_the_tile_layout_is_the_one_drawn():
    """Pair p of tile t: quads j of 16 rows x 4 code bytes (A's bytes 4j.., then B's), then d_A,
    d_B, m_A, m_B of the 16 rows as halves; an odd last block's B half has zero codes, A's d and m."""
    _require_tiles()
    blocks = quantize_q4_1(_weights(32, 96, seed=5)).blocks  # 3 blocks: pairs (0, 1) and (2, 2)
    tiles = native.ops().q4_1_row_tiles(blocks)
    block = blocks.reshape(32, 3, 20)
    for t in range(2):
        for p in range(2):
            pair = tiles[t, p * PAIR_BYTES:(p + 1) * PAIR_BYTES]
            codes = pair[:512].reshape(8, TILE_ROWS, 4)
            halves = pair[512:].reshape(4, TILE_ROWS, 2)
            rows = block[t * TILE_ROWS:(t + 1) * TILE_ROWS]
            a = rows[:, 2 * p]
            b = rows[:, 2 * p + 1] if 2 * p + 1 < 3 else None
            for j in range(8):
                source = a if j < 4 else b
                expected = torch.zeros(TILE_ROWS, 4, dtype=torch.uint8) if source is None else \
                    source[:, 4 + 4 * (j % 4):8 + 4 * (j % 4)]
                assert torch.equal(codes[j], expected)
            b_or_a = a if b is None else b
            for index, (source, at) in enumerate([(a, 0), (b_or_a, 0), (a, 2), (b_or_a, 2)]):
                assert torch.equal(halves[index], source[:, at:at + 2])


def test_tiles_refuse_what_they_cannot_hold():
    _require_tiles()
    ops = native.ops()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q4_1_row_tiles(quantize_q4_1(_weights(24, 64)).blocks)
    with pytest.raises(RuntimeError, match="whole Q4_1 blocks"):
        ops.q4_1_row_tiles(torch.zeros(16, 30, dtype=torch.uint8))
    tiles = ops.q4_1_row_tiles(quantize_q4_1(_weights(16, 64)).blocks)
    with pytest.raises(RuntimeError, match="do not match in_features"):
        ops.q4_1_tiled_linear(torch.randn(1, 128), tiles)
    with pytest.raises(RuntimeError, match="float32 rows"):
        ops.q4_1_tiled_linear(torch.randn(64), tiles)
