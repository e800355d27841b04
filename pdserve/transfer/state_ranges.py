"""Recurrent state between workers of any tensor-parallel sizes: which byte ranges of which peer
rank's state page hold a rank's share of each state layer.

A state layer's bytes are parts of rows (models/state_sharding.py): the conv window's parts (Gated
DeltaNet q, k, v; Mamba2 x, B, C), each `channels` rows of `conv_window` elements, then the
recurrent state, `heads` rows of the rest of its shape. Rank r of N holds rows [r*R/N, (r+1)*R/N)
of every part, parts in order, so one rank's slot is its share of each part back to back. What a
rank of N needs from the ranks of M is, per part, the overlap of its rows with each of theirs,
contiguous on both sides (`StateSplit.pieces`); pieces adjacent on both sides merge:

    Gated DeltaNet, parts q k v | recurrent;  P one rank, D two ranks
    P rank 0 slot   [ q0 q1 | k0 k1 | v0 v1 | r0 r1 ]
    D rank 0 slot   [ q0 | k0 | v0 | r0 ]   <- 4 pieces of P rank 0
    D rank 1 slot   [ q1 | k1 | v1 | r1 ]   <- 4 pieces of P rank 0
    (P two ranks -> D one rank: D's slot gathers q0 from P rank 0, q1 from P rank 1, ...)

Equal sizes: a rank's slot is one piece of the same rank's slot, and adjacent slots merge into one
range, as between one-rank workers. Torch-free and nixl-free.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from pdserve.kv.specs import STATE_DTYPE_BYTES, KVGroupPlan, RecurrentStateSpec


@dataclass(frozen=True, slots=True)
class StateMove:
    """`num_bytes` of state from byte `remote_offset_bytes` of remote page `remote_page` into byte
    `local_offset_bytes` of local page `local_page` (offsets inside one rank's page on each side)."""

    local_page: int
    local_offset_bytes: int
    remote_page: int
    remote_offset_bytes: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class StatePiece:
    """Bytes [local_offset_bytes, +num_bytes) of a local rank's slot come from bytes
    [remote_offset_bytes, +num_bytes) of remote rank `remote_rank`'s slot."""

    remote_rank: int
    local_offset_bytes: int
    remote_offset_bytes: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class StateSplit:
    """One state layer as the whole model holds it: part i is part_rows[i] rows of row_bytes[i] bytes."""

    part_rows: tuple[int, ...]
    row_bytes: tuple[int, ...]

    @classmethod
    def of(cls, spec: RecurrentStateSpec, num_ranks: int) -> "StateSplit":
        """From one rank's spec of a worker of `num_ranks` ranks."""
        item = STATE_DTYPE_BYTES[spec.dtype]
        conv = spec.conv_parts or (spec.conv_channels,)
        recurrent_row = math.prod(spec.recurrent_shape[1:]) * item
        parts = [(channels * num_ranks, spec.conv_window * item) for channels in conv if spec.conv_window]
        parts.append((spec.recurrent_shape[0] * num_ranks, recurrent_row))
        return cls(tuple(rows for rows, _ in parts), tuple(size for _, size in parts))

    def problem(self, num_ranks: int) -> Optional[str]:
        """Why `num_ranks` ranks cannot each hold an equal share of every part (None: they can)."""
        for index, rows in enumerate(self.part_rows):
            if rows % num_ranks:
                return (f"{num_ranks} ranks do not divide part {index} of a state layer ({rows} rows: conv "
                        f"channels or heads)")
        return None

    def rank_bytes(self, num_ranks: int) -> int:
        return sum(rows // num_ranks * size for rows, size in zip(self.part_rows, self.row_bytes))

    def pieces(self, rank: int, num_ranks: int, remote_num_ranks: int) -> tuple[StatePiece, ...]:
        """Where each byte of rank `rank`'s slot (of `num_ranks`) lives among `remote_num_ranks` ranks."""
        pieces: list[StatePiece] = []
        local_part = remote_part = 0
        for rows, size in zip(self.part_rows, self.row_bytes):
            mine, theirs = rows // num_ranks, rows // remote_num_ranks
            first, end = rank * mine, (rank + 1) * mine
            for remote_rank in range(first // theirs, -(-end // theirs)):
                low, high = max(first, remote_rank * theirs), min(end, (remote_rank + 1) * theirs)
                piece = StatePiece(remote_rank, local_part + (low - first) * size,
                                   remote_part + (low - remote_rank * theirs) * size, (high - low) * size)
                last = pieces[-1] if pieces else None
                if (last is not None and last.remote_rank == remote_rank
                        and last.local_offset_bytes + last.num_bytes == piece.local_offset_bytes
                        and last.remote_offset_bytes + last.num_bytes == piece.remote_offset_bytes):
                    pieces[-1] = dataclasses.replace(last, num_bytes=last.num_bytes + piece.num_bytes)
                else:
                    pieces.append(piece)
            local_part += mine * size
            remote_part += theirs * size
        return tuple(pieces)

    def boundary_bytes(self, num_ranks: int, remote_num_ranks: int) -> tuple[int, ...]:
        """Every offset and length a read between these sizes cuts at (a chunk must divide them all)."""
        found = {self.rank_bytes(num_ranks), self.rank_bytes(remote_num_ranks)}
        for rank in range(num_ranks):
            for piece in self.pieces(rank, num_ranks, remote_num_ranks):
                found |= {piece.local_offset_bytes, piece.remote_offset_bytes, piece.num_bytes}
        return tuple(sorted(found - {0}))


@dataclass(frozen=True, slots=True)
class StateSlotMove:
    """One state layer: its slot at byte `remote_offset_bytes` of remote page `remote_page` (in a
    remote rank's page) into its slot at byte `local_offset_bytes` of local page `local_page`."""

    local_page: int
    local_offset_bytes: int
    remote_page: int
    remote_offset_bytes: int
    split: StateSplit


def rank_state_moves(slot_moves: Sequence[StateSlotMove], rank: int, num_ranks: int,
                     remote_num_ranks: int) -> dict[int, list[StateMove]]:
    """Per remote rank, the byte ranges rank `rank` of `num_ranks` reads, in slot order, runs adjacent
    on both sides merged (equal sizes: a run of adjacent slots is one range)."""
    moves: dict[int, list[StateMove]] = {}
    for slot in slot_moves:
        for piece in slot.split.pieces(rank, num_ranks, remote_num_ranks):
            move = StateMove(slot.local_page, slot.local_offset_bytes + piece.local_offset_bytes, slot.remote_page,
                             slot.remote_offset_bytes + piece.remote_offset_bytes, piece.num_bytes)
            runs = moves.setdefault(piece.remote_rank, [])
            last = runs[-1] if runs else None
            if (last is not None and (last.local_page, last.remote_page) == (move.local_page, move.remote_page)
                    and last.local_offset_bytes + last.num_bytes == move.local_offset_bytes
                    and last.remote_offset_bytes + last.num_bytes == move.remote_offset_bytes):
                runs[-1] = dataclasses.replace(last, num_bytes=last.num_bytes + move.num_bytes)
            else:
                runs.append(move)
    return moves


def state_splits(plan: KVGroupPlan, num_ranks: int) -> tuple[StateSplit, ...]:
    """The splits of a plan's state groups (one rank's plan of a worker of `num_ranks` ranks)."""
    return tuple(StateSplit.of(group.spec, num_ranks) for group in plan.groups
                 if isinstance(group.spec, RecurrentStateSpec))


def rank_state_spec(spec: RecurrentStateSpec, num_ranks: int, other_num_ranks: int) -> RecurrentStateSpec:
    """One rank's spec of a worker of `other_num_ranks` ranks, from one rank's of `num_ranks`
    (ValueError naming the counts when they do not split)."""
    problem = StateSplit.of(spec, num_ranks).problem(other_num_ranks)
    if problem is not None:
        raise ValueError(problem)
    scaled = [count * num_ranks // other_num_ranks for count in (spec.conv_parts or ())]
    heads = spec.recurrent_shape[0] * num_ranks // other_num_ranks
    return dataclasses.replace(spec, conv_channels=spec.conv_channels * num_ranks // other_num_ranks,
                               conv_parts=tuple(scaled), recurrent_shape=(heads, *spec.recurrent_shape[1:]))
