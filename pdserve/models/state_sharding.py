"""Tensor-parallel slices of the recurrent-state mixers (Gated DeltaNet, Mamba2): which heads, groups,
projection rows and conv channels each rank owns.

State heads split by rank with the rule the KV heads use (`pdserve.kv.head_split`), but a state
head is never replicated: rank r of N owns an equal, contiguous share of every head kind, so its
conv window and recurrent state are exactly its heads' (the `RecurrentStateSpec` it declares is its
share). The mixers load the whole float tensors (`ShardedWeights` passes their names through) and
cut them here:

    Gated DeltaNet (Hk key heads, Hv value heads, Hv/Hk value heads per key head), N = 2:
      key heads      k0 k1 | k2 k3           rank r: key heads [r*Hk/N, (r+1)*Hk/N)
      value heads    v0..v3 | v4..v7         and the value heads of those key heads
      in_proj rows   [q | k | v | z | b | a] each part cut to the rank's heads (column parallel)
      conv channels  [q | k | v]             the same cut
      A_log, dt_bias per value head;  gated norm per head: replicated
      out_proj       input columns of the rank's value heads (row parallel, all-reduced)

    Mamba2 (H heads, G groups of H/G heads sharing B and C), N = 2, G = 2:
      heads          h0..h3 | h4..h7         rank r: heads [r*H/N, ...) = groups [r*G/N, ...)
      in_proj rows   [z | x | B | C | dt]    z, x, dt by head; B, C by group
      conv channels  [x | B | C]             the same cut; A_log, D, dt_bias by head
      grouped norm   the rank's groups' channels (a group never spans ranks, so it stays local)
      out_proj       input columns of the rank's heads; its bias added once (rank 0)

A rank's state is its heads' state, laid out like the whole layer's: its recurrent state is one
contiguous range of the whole one's heads (heads outermost), but its conv window's channels are its
share of each conv part in turn, so the whole window is the ranks' windows interleaved by part:

    whole conv window   [ q0 q1 | k0 k1 | v0 v1 ]      (Mamba2: [ x0 x1 | B0 B1 | C0 C1 ])
    rank 0 / rank 1     [ q0 | k0 | v0 ]  /  [ q1 | k1 | v1 ]

A P/D pull between workers of different TP sizes moves each rank's share part by part, as byte
ranges of the peer ranks' slots (`conv_parts` in the spec names the parts; transfer/state_ranges.py).

Invariant: summed over the ranks, the mixers' row-parallel outputs equal the whole mixer's output.
A size that does not divide the key heads or the Mamba2 groups is refused (UnsupportedModelFeature
naming the counts): Mamba2 groups are not replicated because the grouped norm would then span ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pdserve.models.hf_config import UnsupportedModelFeature


@dataclass(frozen=True, slots=True)
class StateShard:
    """This rank's place among `size` ranks, as a state mixer sees it."""

    rank: int
    size: int

    def share(self, count: int) -> slice:
        """This rank's items of `count` equal-width items (a multiple of size)."""
        width = count // self.size
        return slice(self.rank * width, (self.rank + 1) * width)

    def rows(self, num_items: int, item_rows: int) -> slice:
        """This rank's rows of a block of `num_items` items of `item_rows` rows each."""
        items = self.share(num_items)
        return slice(items.start * item_rows, items.stop * item_rows)

    def added_once(self, bias: torch.Tensor) -> torch.Tensor:
        """A row-parallel bias: rank 0 adds it, the other ranks add zeros."""
        return bias if self.rank == 0 else torch.zeros_like(bias)


def cut_rows(parts: Sequence[torch.Tensor], spans: Sequence[slice]) -> list[torch.Tensor]:
    """Each part's rows in its span, in their own storage."""
    return [part[span].contiguous() for part, span in zip(parts, spans)]


def state_split_problem(size: int, what: str, counts: Sequence[tuple[str, int]]) -> Optional[str]:
    """Why `size` ranks cannot split a state mixer whose head kinds have these counts (None: they can)."""
    for name, count in counts:
        if count % size:
            return (f"--tensor-parallel-size {size} does not divide the model's {count} {what} {name} "
                    f"(state heads are split, never replicated: every count must be a multiple of the size)")
    return None


def refuse_state_split(size: int, what: str, counts: Sequence[tuple[str, int]]) -> None:
    problem = state_split_problem(size, what, counts)
    if problem is not None:
        raise UnsupportedModelFeature(problem)
