"""The chunked selective scan agrees with the one-step recurrence run row by row, for several
sequences of mixed lengths in one flat batch, from non-zero starting states, whatever the chunk length."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.ssd_scan import ssd_chunked_scan, ssd_step

HEADS, HEAD_DIM, GROUPS, STATE = 4, 8, 2, 6
LENGTHS = (70, 1, 13, 130)


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(LENGTHS)
    x = torch.randn(rows, HEADS, HEAD_DIM, generator=generator)
    dt = F.softplus(torch.randn(rows, HEADS, generator=generator) - 1.0)
    A = -torch.rand(HEADS, generator=generator) * 4 - 0.1
    B = torch.randn(rows, GROUPS, STATE, generator=generator)
    C = torch.randn(rows, GROUPS, STATE, generator=generator)
    initial = torch.randn(len(LENGTHS), HEADS, HEAD_DIM, STATE, generator=generator)
    starts = [0]
    for n in LENGTHS:
        starts.append(starts[-1] + n)
    return x, dt, A, B, C, initial, starts


def _row_by_row(x, dt, A, B, C, initial, starts):
    outputs, finals = [], []
    for index in range(len(starts) - 1):
        state = initial[index : index + 1]
        for row in range(starts[index], starts[index + 1]):
            y, state = ssd_step(state, x[row : row + 1], dt[row : row + 1], A, B[row : row + 1], C[row : row + 1])
            outputs.append(y)
        finals.append(state)
    return torch.cat(outputs), torch.cat(finals)


@pytest.mark.parametrize("chunk_tokens", [64, 16, 7])
def test_chunked_scan_matches_the_recurrence_row_by_row(chunk_tokens):
    x, dt, A, B, C, initial, starts = _inputs(0)
    expected_y, expected_state = _row_by_row(x, dt, A, B, C, initial, starts)
    y, state = ssd_chunked_scan(x, dt, A, B, C, starts, initial, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(y, expected_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_a_head_reads_the_group_its_index_falls_in():
    """Heads 0-1 read group 0 and heads 2-3 group 1: zeroing group 1's B leaves heads 0-1 alone."""
    x, dt, A, B, C, initial, starts = _inputs(1)
    zero = torch.zeros_like(initial)
    y, _ = ssd_chunked_scan(x, dt, A, B, C, starts, zero)
    B_cut = B.clone()
    B_cut[:, 1] = 0
    y_cut, _ = ssd_chunked_scan(x, dt, A, B_cut, C, starts, zero)
    torch.testing.assert_close(y_cut[:, :2], y[:, :2])
    assert y_cut[:, 2:].abs().max() == 0
