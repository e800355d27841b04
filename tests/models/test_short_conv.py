"""The short causal convolution over a flat batch agrees with one plain conv1d over each whole
sequence, however the sequence is cut into passes and batched with others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.models.short_conv import causal_conv

CHANNELS, TAPS = 6, 4


def _reference(sequence: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Whole sequence [n, channels] at once, zero history, as transformers' torch path computes it."""
    padded = F.conv1d(sequence.T.unsqueeze(0), weight.unsqueeze(1), bias, padding=TAPS - 1, groups=CHANNELS)
    return padded[0, :, : sequence.shape[0]].T


def test_passes_of_mixed_lengths_and_decode_rows_match_one_whole_pass():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(CHANNELS, TAPS, generator=generator), torch.randn(CHANNELS, generator=generator)
    sequences = [torch.randn(n, CHANNELS, generator=generator) for n in (9, 2, 13)]
    expected = [_reference(s, weight, bias) for s in sequences]
    windows = torch.zeros(3, CHANNELS, TAPS - 1)
    got: list[list[torch.Tensor]] = [[], [], []]
    # Pass 1: uneven prefill chunks of all three; then single rows (the vectorised decode path).
    cuts = [(0, 5), (0, 1), (0, 7)]
    rows = torch.cat([s[a:b] for s, (a, b) in zip(sequences, cuts)])
    starts = [0]
    for a, b in cuts:
        starts.append(starts[-1] + b - a)
    y, windows = causal_conv(rows, starts, windows, weight, bias)
    for index in range(3):
        got[index].append(y[starts[index] : starts[index + 1]])
    position = [b for _, b in cuts]
    while any(p < s.shape[0] for p, s in zip(position, sequences)):
        live = [i for i in range(3) if position[i] < sequences[i].shape[0]]
        rows = torch.stack([sequences[i][position[i]] for i in live])
        y, new_windows = causal_conv(rows, list(range(len(live) + 1)), windows[live], weight, bias)
        for row, index in enumerate(live):
            got[index].append(y[row : row + 1])
            windows[index] = new_windows[row]
            position[index] += 1
    for index in range(3):
        torch.testing.assert_close(torch.cat(got[index]), expected[index])
