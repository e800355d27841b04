"""Decode side, async: where a decode leg sent beside its prefill leg waits for P's kv_transfer_params.

With concurrent legs the proxy sends D the request while P still computes it. D parses, tokenizes and
validates it, then waits here under the proxy's random key (`awaited_ticket`) until the proxy delivers
P's answer (`POST /internal/kv/ticket`), or calls the leg off (P failed: nothing delivered), or D's own
bound runs out. Delivery and wait may come in either order: whichever comes first opens the slot.

    proxy ── decode leg {awaited_ticket: K} ──▶ D: parse, tokenize ──▶ wait(K) ─┐
    proxy ── prefill leg ──▶ P ── kv_transfer_params ──▶ proxy                 │
    proxy ── POST /internal/kv/ticket {K, params | null} ──▶ D: deliver(K) ─────┴─▶ claim the pin from P ...

Invariants: a slot is handed out once (a second delivery, or a second wait, under one key is refused);
every slot leaves the inbox: the waiter removes its own (answered, timed out or cancelled: its client
went away), and a delivery nobody waits for is dropped after `wait_s`; at most `max_slots` slots exist
(past that a wait or delivery is refused at once, never queued). What is delivered is only a ticket:
D claims the blocks, the prompt digest and the first token from P itself (pd/tickets.py), so whoever
delivers cannot make D read KV that is not its prompt's. One event loop (the worker's): not thread-safe.
Torch-free.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pdserve.api.kv_transfer import KVTicketNotDelivered

NOT_DELIVERED = None  # what a call-off delivers: P failed, the leg is over


class Delivery(enum.Enum):
    ACCEPTED = "accepted"  # a waiter has it, or will when its leg arrives
    DUPLICATE = "duplicate"  # the key was delivered to already
    FULL = "full"  # too many slots: refused


@dataclass(slots=True)
class _Slot:
    deadline_s: float  # a delivery nobody waits for is dropped past this
    future: "asyncio.Future[Optional[dict[str, Any]]]"
    waited: bool = False  # a decode leg waits (or waited) on it


class TicketInbox:
    def __init__(self, wait_s: float, max_slots: int = 4096, clock: Callable[[], float] = time.monotonic):
        """`wait_s`: the longest a decode leg waits for its ticket (D's bound, whatever the proxy does)."""
        self.wait_s = wait_s
        self.max_slots = max_slots
        self.clock = clock
        self._slots: dict[str, _Slot] = {}

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def num_waiting(self) -> int:
        return sum(1 for slot in self._slots.values() if slot.waited)

    def deliver(self, key: str, params: Optional[dict[str, Any]]) -> Delivery:
        """P's kv_transfer_params for the leg waiting under `key` (None: call it off)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._open(key)
            if slot is None:
                return Delivery.FULL
        if slot.future.done():
            return Delivery.DUPLICATE
        slot.future.set_result(params)
        return Delivery.ACCEPTED

    async def wait(self, key: str) -> dict[str, Any]:
        """The params delivered under `key`. KVTicketNotDelivered: called off, not delivered within
        `wait_s`, a second wait on the key, or the inbox is full. Cancelled (the client went away):
        the slot is gone too."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._open(key)
            if slot is None:
                raise KVTicketNotDelivered("too many decode legs wait for their prefill: retry later")
        elif slot.waited:
            raise KVTicketNotDelivered("another decode leg waits under this ticket key")
        slot.waited = True
        try:
            params = await asyncio.wait_for(asyncio.shield(slot.future), self.wait_s)
        except asyncio.TimeoutError:
            raise KVTicketNotDelivered(f"no prefill answer was delivered within {self.wait_s:g} s") from None
        finally:
            self._slots.pop(key, None)
        if params is NOT_DELIVERED:
            raise KVTicketNotDelivered("the proxy called the decode leg off: its prefill failed")
        return params

    def _open(self, key: str) -> Optional[_Slot]:
        self._drop_stale()
        if len(self._slots) >= self.max_slots:
            return None
        slot = _Slot(self.clock() + self.wait_s, asyncio.get_running_loop().create_future())
        self._slots[key] = slot
        return slot

    def _drop_stale(self) -> None:
        """Deliveries nobody came to wait for within `wait_s` (the leg never arrived, or was refused first)."""
        now = self.clock()
        for key in [key for key, slot in self._slots.items() if not slot.waited and now > slot.deadline_s]:
            del self._slots[key]
