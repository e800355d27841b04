"""The short causal depthwise convolution of Gated DeltaNet and Mamba2, over a flat batch.

Each channel c of a sequence's inputs is convolved with its own kernel weight[c] (K taps), causally:
output row t sees inputs t-K+1..t, where inputs before the sequence's first row in this pass come
from its conv window (the last K-1 inputs of earlier passes; zeros for a new sequence). The window
after the pass is what the next pass of the sequence continues from.

    one sequence, K = 4, window W = 3, this pass's rows x0 x1:
      window [w0 w1 w2] + rows [x0 x1] -> padded [w0 w1 w2 x0 x1]
      y0 = k . [w0 w1 w2 x0],   y1 = k . [w1 w2 x0 x1],   new window [w2 x0 x1]

The activation (SiLU in both families) is left to the caller.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, sequence_starts: Sequence[int], window: torch.Tensor, weight: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, channels] of the flat batch, window [sequences, channels, K-1], weight [channels, K],
    bias [channels] or None -> (y [rows, channels], the windows after the pass, same shape as
    `window`, in its dtype)."""
    num_sequences = len(sequence_starts) - 1
    width = window.shape[-1]
    if weight.shape[-1] != width + 1:
        raise ValueError(f"a {weight.shape[-1]}-tap kernel needs a window of {weight.shape[-1] - 1}, got {width}")
    if x.shape[0] == num_sequences:  # one row per sequence (decode): one vectorised step
        padded = torch.cat([window.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [sequences, channels, K]
        y = (padded * weight.unsqueeze(0)).sum(-1)
        if bias is not None:
            y = y + bias
        return y, padded[..., 1:].to(window.dtype)
    outputs, windows = [], []
    for index in range(num_sequences):
        start, end = sequence_starts[index], sequence_starts[index + 1]
        padded = torch.cat([window[index].to(x.dtype), x[start:end].transpose(0, 1)], dim=-1)  # [channels, W + n]
        y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]  # [channels, n]
        outputs.append(y.transpose(0, 1))
        windows.append(padded[:, padded.shape[-1] - width:])
    return torch.cat(outputs), torch.stack(windows).to(window.dtype)
