"""Reads between workers of different block sizes: the unit of tokens both sides agree on, and the
byte chunks of one rank's pages a read of such units touches.

With heads outermost (pdserve/kv/layout.py) a page is a run of rows, one per (KV head, layer
slot, K|V), each row `block_size` tokens of head_dim elements. When P and D page the prompt in
blocks of different sizes (one must divide the other), a P page is no longer one range of a D
page: its rows interleave with the rows of its neighbours. Both sides then count the prompt in
units of the smaller block size; a unit is that many tokens of one row, contiguous on both sides:

    P (block 16, 1 unit per row)          D (block 32, 2 units per row)
    page 7: [h0 s0 K t0-15][h0 s0 V t0-15][h0 s1 K ...] ...
    page 8: [h0 s0 K t16-31][h0 s0 V t16-31] ...
                                          page 3: [h0 s0 K t0-15 | t16-31][h0 s0 V t0-15 | t16-31] ...
                                                   ^ P page 7    ^ P page 8

The planner (pdserve/transfer/planner.py) names units as `block * units_per_row + slot` on each
side. A unit pair becomes one chunk pair per row of the heads read; a chunk is `unit_bytes` bytes
and chunk ids count them from the start of the pool:

    chunk(block, row, slot) = block * rows_per_page * units_per_row + row * units_per_row + slot

Equal block sizes need none of this (one unit per row, rows of a head range contiguous): a head
range of a page is one chunk there (pdserve/kv/head_split.py). Torch-free and nixl-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def block_size_problem(local_block_size: int, remote_block_size: int) -> Optional[str]:
    """Why two block sizes cannot pair (None when they can)."""
    small, large = sorted((local_block_size, remote_block_size))
    if small < 1 or large % small:
        return (f"block sizes {local_block_size} here and {remote_block_size} there: one must divide the other "
                f"(KV moves in units of the smaller block)")
    return None


@dataclass(frozen=True, slots=True)
class UnitGrid:
    """One rank's page seen as rows of units."""

    rows_per_page: int  # (KV heads of the rank) * (layer slots) * 2
    units_per_row: int  # block_size // unit_tokens

    @property
    def chunks_per_page(self) -> int:
        return self.rows_per_page * self.units_per_row


@dataclass(frozen=True, slots=True)
class UnitGeometry:
    """How reads between two ranks whose row lengths differ are cut: into chunks of `unit_bytes`."""

    unit_bytes: int
    local: UnitGrid
    remote: UnitGrid


def unit_geometry(local_page_bytes: int, local_rows: int, remote_page_bytes: int, remote_rows: int) -> UnitGeometry:
    """From each side's page size and row count (heads * slots * 2); ValueError when a page does not
    hold whole rows or one row length does not divide the other."""
    row_bytes = []
    for side, page_bytes, rows in (("local", local_page_bytes, local_rows), ("remote", remote_page_bytes, remote_rows)):
        if rows < 1 or page_bytes % rows:
            raise ValueError(f"{side} pages of {page_bytes} bytes do not hold {rows} equal rows")
        row_bytes.append(page_bytes // rows)
    local_row, remote_row = row_bytes
    unit = min(local_row, remote_row)
    if max(local_row, remote_row) % unit:
        raise ValueError(f"rows of {local_row} bytes here and {remote_row} there: one must divide the other")
    return UnitGeometry(unit, UnitGrid(local_rows, local_row // unit), UnitGrid(remote_rows, remote_row // unit))


def unit_chunk_ids(grid: UnitGrid, unit_ids: Sequence[int], first_row: int, num_rows: int) -> np.ndarray:
    """Chunk ids of rows [first_row, first_row + num_rows) of every unit, unit by unit (rows inner),
    so that the local and the remote lists of one read pair up entry by entry."""
    units = np.asarray(unit_ids, dtype=np.int64).reshape(-1)
    blocks, slots = np.divmod(units, grid.units_per_row)
    rows = np.arange(first_row, first_row + num_rows, dtype=np.int64) * grid.units_per_row
    return ((blocks * grid.chunks_per_page + slots)[:, None] + rows[None, :]).reshape(-1)
