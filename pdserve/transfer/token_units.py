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

Pages padded for recurrent state (kv/page_geometry.py) end after their rows in padding, and a
state slot is no whole number of units: then a unit is cut into `chunks_per_unit` chunks of a size
that divides the units, both page sizes and every state slot (`padded_unit_geometry`), so a state
slot is a run of chunks too (`byte_chunk_ids`) and both ride one connection:

    chunk(block, row, slot, j) = block * page_chunks + (row * units_per_row + slot) * chunks_per_unit + j

Equal block sizes need none of this (one unit per row, rows of a head range contiguous): a head
range of a page is one chunk there (pdserve/kv/head_split.py). Torch-free and nixl-free.
"""

from __future__ import annotations

import math
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
    chunks_per_unit: int = 1  # > 1 when a unit is cut finer (padded pages, state slots)
    page_chunks: int = 0  # chunks in a page, padding included (0: the rows alone fill the page)

    @property
    def chunks_per_page(self) -> int:
        return self.page_chunks or self.rows_per_page * self.units_per_row * self.chunks_per_unit


@dataclass(frozen=True, slots=True)
class UnitGeometry:
    """How reads between two ranks whose row lengths differ are cut: into chunks of `unit_bytes`."""

    unit_bytes: int
    local: UnitGrid
    remote: UnitGrid

    @property
    def chunk_bytes(self) -> int:
        """What one id of a read names (a unit, or a piece of one)."""
        return self.unit_bytes // self.local.chunks_per_unit


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


def padded_unit_geometry(local_row_bytes: int, local_rows: int, local_page_bytes: int, remote_row_bytes: int,
                         remote_rows: int, remote_page_bytes: int,
                         slot_bytes: Sequence[int] = ()) -> UnitGeometry:
    """Like `unit_geometry`, from each side's row length, rows and page size (padding included), with
    chunks that also divide both pages and every size in `slot_bytes` (one state layer's slot)."""
    for side, row_bytes, rows, page_bytes in (("local", local_row_bytes, local_rows, local_page_bytes),
                                              ("remote", remote_row_bytes, remote_rows, remote_page_bytes)):
        if row_bytes < 1 or rows < 1 or rows * row_bytes > page_bytes:
            raise ValueError(f"{side} pages of {page_bytes} bytes do not hold {rows} rows of {row_bytes} bytes")
    unit = min(local_row_bytes, remote_row_bytes)
    if max(local_row_bytes, remote_row_bytes) % unit:
        raise ValueError(f"rows of {local_row_bytes} bytes here and {remote_row_bytes} there: one must divide "
                         f"the other")
    chunk = math.gcd(unit, local_page_bytes, remote_page_bytes, *slot_bytes)
    per_unit = unit // chunk
    return UnitGeometry(unit, UnitGrid(local_rows, local_row_bytes // unit, per_unit, local_page_bytes // chunk),
                        UnitGrid(remote_rows, remote_row_bytes // unit, per_unit, remote_page_bytes // chunk))


def byte_chunk_ids(grid: UnitGrid, chunk_bytes: int, page: int, offset_bytes: int, num_bytes: int) -> np.ndarray:
    """Chunk ids of bytes [offset_bytes, offset_bytes + num_bytes) of one page (ValueError unless both
    ends fall on chunk boundaries inside the page)."""
    first, tail = divmod(offset_bytes, chunk_bytes)
    count, rest = divmod(num_bytes, chunk_bytes)
    if tail or rest or offset_bytes < 0 or num_bytes < 1 or first + count > grid.chunks_per_page:
        raise ValueError(f"bytes {offset_bytes}..{offset_bytes + num_bytes} of a page of {grid.chunks_per_page} "
                         f"chunks of {chunk_bytes} bytes are no run of whole chunks")
    return page * grid.chunks_per_page + first + np.arange(count, dtype=np.int64)


def unit_chunk_ids(grid: UnitGrid, unit_ids: Sequence[int], first_row: int, num_rows: int) -> np.ndarray:
    """Chunk ids of rows [first_row, first_row + num_rows) of every unit, unit by unit (rows inner),
    so that the local and the remote lists of one read pair up entry by entry."""
    units = np.asarray(unit_ids, dtype=np.int64).reshape(-1)
    blocks, slots = np.divmod(units, grid.units_per_row)
    rows = np.arange(first_row, first_row + num_rows, dtype=np.int64) * grid.units_per_row
    firsts = ((blocks * grid.chunks_per_page + slots * grid.chunks_per_unit)[:, None]
              + (rows * grid.chunks_per_unit)[None, :])
    pieces = np.arange(grid.chunks_per_unit, dtype=np.int64)
    return (firsts[:, :, None] + pieces[None, None, :]).reshape(-1)
