"""Holder side of a peer pull: pin the longest prefix of a token list that this worker holds, in its
pool or in its offload tier, for a peer to READ.

Invariant: the blocks a peer may read are found by this worker's own block-hash chain of the tokens it
was sent (never ids a caller named), and stay referenced under a pin id of their own (a KV-manager
entry no scheduler request owns) from the moment the pin is made until the lease table releases it:
the puller's "done" or "free" (with the pin's nonce, over the transport), an early release
(`/internal/kv/release` with the nonce), lease expiry, or this module giving up on a tier load. A
ticket names only blocks cached under the hash it names: a block loaded from the tier is named once
its load landed (the KV manager caches it then), never while its pages are still being copied.

    token ids ──hash chain──▶ match: pool first, then the tier          (engine thread)
        pool hit  [b3 b9 ..]  referenced as they are
        tier hit  [s4 s7 ..]  fresh pool blocks, loaded by the KV manager's own tier read
                               (kv.start_tier_read: the same load a local prefix hit uses)
    no tier page ─▶ ticket at once
    tier pages   ─▶ LoadingPin ─▶ the scheduler's poll reports the load ─▶ ticket of every block
                     past TIER_LOAD_WAIT_S or a failed load ─▶ ticket of the leading pool blocks
                     (none: the pin is released, 404, the puller computes)

The pin lives in the worker's lease table (pd/lending.py: a prefill worker's, shared with its P/D
pins, or a decode worker's, whose prefixes include its answers) from its start, so every release path
of a P/D pin applies unchanged (its poll reports the id released and the scheduler frees it; the blocks stay in
the prefix cache, merely unreferenced), and a pin whose answer nobody awaits any more goes with its
lease. Tier pages take fresh blocks only from the pool's free ones (uncached, or cached and
unreferenced), at most MAX_FREE_SHARE of them, so a pin never takes a block a running request holds or
the room it is about to grow into; a prefix longer than that room is pinned as far as it fits. Models
with recurrent state or sliding windows are refused (a window's blocks are not a prefix's: not done
yet). Torch-free.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence, TypeVar, Union

from pdserve.api.kv_transfer import KVPinnedFull
from pdserve.api.peer_pull import PeerPinRefused, PeerPinTicket
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.prefix import PrefixHit, match_prefix
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan
from pdserve.pd.leases import Lease
from pdserve.pd.lending import PinLender

logger = logging.getLogger(__name__)

PEER_PIN_PREFIX = "peer-pin-"  # pin ids: never a client's request id (those are checked by the registry)
TIER_LOAD_WAIT_S = 2.0  # longest a pin's answer waits for its tier pages (then it names the pool's part only)
TIER_LOAD_POLL_S = 0.001  # how often the waiting answer asks the engine thread whether they landed
MAX_FREE_SHARE = 0.5  # most of the pool's free blocks one pin's tier pages may take

CountPinned = Callable[[str, int], None]  # (medium: "device" or "offload", tokens) lent to a peer
T = TypeVar("T")
RunOnEngine = Callable[[Callable[[], T]], Awaitable[T]]  # run a short function on the engine thread, await it


def peer_pull_problem(plan: KVGroupPlan) -> Optional[str]:
    """Why prefixes of `plan`'s KV cannot move between peers yet (None: full attention only, they can)."""
    kinds = sorted({type(group.spec).__name__ for group in plan.groups if not isinstance(group.spec, FullAttentionSpec)})
    if kinds:
        return f"peer pulls move full-attention KV only; this model has {', '.join(kinds)} groups"
    return None


@dataclass(slots=True)
class LoadingPin:
    """A pin whose tier pages are still being copied into its blocks (engine-thread record, handed to
    the waiting answer and back)."""

    pin_id: str
    lease: Lease  # the lease table's record: its nonce, and when it runs out
    block_hashes: list[bytes]  # one per pinned block
    loaded: frozenset[int]  # indexes of the blocks that come from the tier
    started_s: float  # when the pin was made (the pin's answer measures its wait from here)


PinOutcome = Union[PeerPinTicket, LoadingPin, None]


def pin_peer_prefix(kv: KVCacheManager, lender: PinLender, token_ids: Sequence[int],
                    count_pinned_tokens: CountPinned = lambda medium, num_tokens: None,
                    clock: Callable[[], float] = time.monotonic) -> PinOutcome:
    """Pin the longest prefix of `token_ids` this worker holds (engine thread): the ticket when every
    block is in the pool, a LoadingPin while tier pages load (`settle_peer_pin` answers it), None when it
    holds no block of it. Raises PeerPinRefused (model not supported) or KVPinnedFull (pin limit reached)."""
    problem = peer_pull_problem(kv.plan)
    if problem is not None:
        raise PeerPinRefused(problem)
    if not kv.enable_prefix_caching:
        return None
    pin_id = f"{PEER_PIN_PREFIX}{uuid.uuid4().hex}"
    block_hashes = hash_full_blocks(token_ids, kv.block_size, [])
    hit = _hit_that_fits(kv, pin_id, block_hashes)
    if hit.num_tokens == 0:
        return None
    num_blocks = hit.num_tokens // kv.block_size
    num_pinned = num_blocks * len(kv.plan.groups)
    if not lender.has_room_to_pin(num_pinned):
        lender.metrics.pinned_refusals.inc()
        raise KVPinnedFull(f"this worker holds {lender.num_pinned_blocks} blocks for other workers; "
                           f"{num_pinned} more would pass its limit: compute the prefix instead")
    if not kv.allocate_slots(pin_id, hit.num_tokens, 0, hit):  # references, and fresh blocks for tier pages
        return None
    lease = lender.leases.pin(pin_id, num_pinned)  # no claimable ticket: the answer is the only one
    lender.metrics.pinned_blocks.set(lender.num_pinned_blocks)
    loaded = frozenset(index for indexes in hit.offloaded for index in indexes)
    pin = LoadingPin(pin_id, lease, list(block_hashes[:num_blocks]), loaded, clock())
    if kv.start_tier_read(pin_id):
        logger.info("peer pin %s: loading %d of %d blocks from the offload tier before a peer reads them",
                    pin_id, len(loaded), num_blocks)
        return pin
    return _ticket(kv, lender, pin, num_blocks, count_pinned_tokens)


def settle_peer_pin(kv: KVCacheManager, lender: PinLender, pin: LoadingPin, give_up: bool = False,
                    count_pinned_tokens: CountPinned = lambda medium, num_tokens: None) -> PinOutcome:
    """Engine thread: the ticket of a pin whose tier load ended (every block, or after a failed load the
    leading blocks that were in the pool); `pin` itself while the load runs, unless `give_up`; None (the
    pin released) when no block can be named, or the pin was released meanwhile (its lease ran out)."""
    if not lender.leases.holds(pin.pin_id, pin.lease.nonce):
        return None  # released (lease expiry, an early release): the scheduler freed its blocks
    if kv.is_reading_tier(pin.pin_id) and not give_up:
        return pin
    num_named = _num_cached_blocks(kv, pin)
    if num_named < len(pin.block_hashes):
        logger.warning("peer pin %s: %d of %d blocks readable (the tier load %s)", pin.pin_id, num_named,
                       len(pin.block_hashes), "is late" if kv.is_reading_tier(pin.pin_id) else "failed")
    if num_named == 0:
        if lender.leases.release(pin.pin_id):
            kv.free(pin.pin_id)  # a read still in flight parks its blocks until it ends
            lender.metrics.pinned_blocks.set(lender.num_pinned_blocks)
        return None
    return _ticket(kv, lender, pin, num_named, count_pinned_tokens)


async def await_peer_pin(run_on_engine: RunOnEngine, start: Callable[[], PinOutcome],
                         settle: Callable[[LoadingPin, bool], PinOutcome], wait_s: float = TIER_LOAD_WAIT_S,
                         poll_s: float = TIER_LOAD_POLL_S,
                         clock: Callable[[], float] = time.monotonic) -> Optional[PeerPinTicket]:
    """The async side of a pin: start it on the engine thread, then, while its tier pages load, ask
    again every `poll_s` (never blocking the engine thread), giving up on the load after `wait_s`."""
    outcome = await run_on_engine(start)
    while isinstance(outcome, LoadingPin):
        pin = outcome
        give_up = clock() - pin.started_s >= wait_s
        if not give_up:
            await asyncio.sleep(poll_s)
        outcome = await run_on_engine(lambda: settle(pin, give_up))
    return outcome


def _hit_that_fits(kv: KVCacheManager, pin_id: str, block_hashes: Sequence[bytes]) -> PrefixHit:
    """The longest hit (pool, then tier) whose tier pages fit in the pool's room for them; the pool's own
    part always fits (it takes no new block). Binary search: a longer hit never needs fewer blocks."""
    def hit_of(num_blocks: int) -> PrefixHit:
        return match_prefix(kv.pool, kv.plan, block_hashes, num_blocks, kv.block_size, kv.offload)

    def fits(hit: PrefixHit) -> bool:
        return (hit.num_offloaded_blocks <= int(kv.num_free_blocks * MAX_FREE_SHARE)
                and kv.can_allocate_slots(pin_id, hit.num_tokens, 0, hit))

    longest = hit_of(len(block_hashes))
    if fits(longest):
        return longest
    low, high = 0, longest.num_tokens // kv.block_size  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(hit_of(middle)) else (low, middle)
    return hit_of(low)


def _num_cached_blocks(kv: KVCacheManager, pin: LoadingPin) -> int:
    """Leading blocks of the pin cached under the hash the ticket will name (a tier page joins the cache
    when its load landed; a pool block was cached when pinned and stays, being referenced)."""
    tables = kv.block_ids(pin.pin_id)
    for index, block_hash in enumerate(pin.block_hashes):
        if any(kv.pool.lookup(block_hash, group_id) != table[index] for group_id, table in enumerate(tables)):
            return index
    return len(pin.block_hashes)


def _ticket(kv: KVCacheManager, lender: PinLender, pin: LoadingPin, num_blocks: int,
            count_pinned_tokens: CountPinned) -> PeerPinTicket:
    """The answer naming the pin's first `num_blocks` blocks (the pin may hold more: they go with it)."""
    num_loaded = sum(1 for index in pin.loaded if index < num_blocks)
    if num_blocks > num_loaded:
        count_pinned_tokens("device", (num_blocks - num_loaded) * kv.block_size)
    if num_loaded:
        count_pinned_tokens("offload", num_loaded * kv.block_size)
    identity = lender.identity
    lease_left_s = max(0.0, pin.lease.expires_at_s - lender.leases.clock())
    logger.info("peer pin %s: %d tokens (%d blocks, %d from the offload tier) pinned for a peer (lease %.0fs)",
                pin.pin_id, num_blocks * kv.block_size, num_blocks, num_loaded, lease_left_s)
    return PeerPinTicket(pin_id=pin.pin_id, engine_id=identity.engine_id, epoch=identity.epoch, nonce=pin.lease.nonce,
                         num_tokens=num_blocks * kv.block_size, block_size=kv.block_size,
                         block_ids=[list(ids[:num_blocks]) for ids in kv.block_ids(pin.pin_id)],
                         block_hashes=[block_hash.hex() for block_hash in pin.block_hashes[:num_blocks]],
                         lease_left_s=lease_left_s)
