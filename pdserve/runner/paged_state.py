"""Recurrent state (Gated DeltaNet, Mamba2) read from and written to the paged pool for one step.

A request holds one live state page per state group (its one-entry table in that group, see
pdserve/kv/manager.py); slot s of the page holds layer group.layer_ids[s]'s conv window and
recurrent tensor (pdserve/kv/layout.py). Invariant: a layer reads, for each chunk of the step,
the state its request left after its previous token (zeros for a chunk that starts the
request's sequence, whatever the page held before), and writes back the state after the chunk's
last token; nothing else of the page changes.

    step of three chunks (flat batch order), one state group, layer in slot 1:
      chunk      rows      live page   read                  write
      A (decode) [0, 1)    17          page 17, slot 1       page 17, slot 1
      B (decode) [1, 2)    4           page 4,  slot 1       page 4,  slot 1
      C (prefill, starts)  [2, 40)  9  zeros                 page 9,  slot 1

Page copies the scheduler asks for (snapshots for the prefix cache, restores from them) run
before the forward pass, in order (`copy_state_pages`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.specs import KVGroupPlan, RecurrentStateSpec

# Per layer id: (group id, conv view [num_pages, channels, window], recurrent view [num_pages, *shape]),
# or None for an attention layer.
StateViews = Sequence[Optional[tuple[int, torch.Tensor, torch.Tensor]]]


def state_views_of(plan: KVGroupPlan, layout: Any, pool: torch.Tensor) -> list[Optional[tuple[int, torch.Tensor, torch.Tensor]]]:
    """Every state layer's views into the pool, indexed by layer id (None for attention layers)."""
    views: list[Optional[tuple[int, torch.Tensor, torch.Tensor]]] = [None] * plan.num_layers
    for group in plan.groups:
        if not isinstance(group.spec, RecurrentStateSpec):
            continue
        for slot, layer_id in enumerate(group.layer_ids):
            conv, recurrent = layout.state_views(pool, group, slot)
            views[layer_id] = (group.group_id, conv, recurrent)
    return views


def copy_state_pages(canonical_pool: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
    """Copy whole pages (source, destination), in order: a later copy may read what an earlier wrote."""
    for source, destination in copies:
        canonical_pool[destination].copy_(canonical_pool[source])


class PagedState:
    """`RecurrentStateContext` over the pool for one step's chunks (already in flat-batch order)."""

    def __init__(self, views: StateViews, chunks: Sequence[ScheduledChunk], device: torch.device):
        self.views = views
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + chunk.num_tokens)
        self._starts = starts
        self._chunks = chunks
        self._device = device
        self._pages_by_group: dict[int, torch.Tensor] = {}
        fresh = [index for index, chunk in enumerate(chunks) if chunk.start_position == 0]
        self._fresh = torch.tensor(fresh, dtype=torch.int64, device=device) if fresh else None

    def sequence_starts(self) -> list[int]:
        return list(self._starts)

    def read_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        group_id, conv_view, recurrent_view = self._views_of(layer_id)
        pages = self._pages(group_id)
        conv, recurrent = conv_view.index_select(0, pages), recurrent_view.index_select(0, pages)
        if self._fresh is not None:  # a sequence's first chunk starts from zeros, not the page's old bytes
            conv.index_fill_(0, self._fresh, 0)
            recurrent.index_fill_(0, self._fresh, 0)
        return conv, recurrent

    def write_state(self, layer_id: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        group_id, conv_view, recurrent_view = self._views_of(layer_id)
        pages = self._pages(group_id)
        conv_view.index_copy_(0, pages, conv.to(conv_view.dtype))
        recurrent_view.index_copy_(0, pages, recurrent.to(recurrent_view.dtype))

    def _views_of(self, layer_id: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        views = self.views[layer_id]
        if views is None:
            raise ValueError(f"layer {layer_id} holds no recurrent state")
        return views

    def _pages(self, group_id: int) -> torch.Tensor:
        pages = self._pages_by_group.get(group_id)
        if pages is None:
            ids = [_live_page(chunk, group_id) for chunk in self._chunks]
            pages = torch.tensor(ids, dtype=torch.int64).to(self._device, non_blocking=True)
            self._pages_by_group[group_id] = pages
        return pages


def _live_page(chunk: ScheduledChunk, group_id: int) -> int:
    table = chunk.block_ids[group_id]
    if len(table) != 1 or table[0] <= 0:
        raise ValueError(f"request {chunk.request_id}: state group {group_id} table {table} is not one live page")
    return table[0]


class AttentionAndState:
    """The one context object a hybrid model's layers get: attention from `attention`, state from `state`."""

    def __init__(self, attention: Any, state: PagedState):
        self._attention = attention
        self._state = state

    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._attention.attend(*args, **kwargs)

    def sequence_starts(self) -> list[int]:
        return self._state.sequence_starts()

    def read_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state.read_state(layer_id)

    def write_state(self, layer_id: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self._state.write_state(layer_id, conv, recurrent)
