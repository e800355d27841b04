"""Holder side of a peer pull, engine thread: pin the longest prefix of a token list that this worker's
pool holds, for a peer to READ.

Invariant: the blocks a peer may read are found by this worker's own block-hash chain of the tokens it
was sent (never ids a caller named), and stay referenced under a pin id of their own (a KV-manager
entry no scheduler request owns) from the moment the ticket exists until the lease table releases the
pin: the puller's "done" or "free" (with the pin's nonce, over the transport), an early release
(`/internal/kv/release` with the nonce) or lease expiry. The pin lives in the prefill connector's lease
table, so every release path of a P/D pin applies unchanged: its poll reports the id released and the
scheduler frees it (the blocks stay in the prefix cache, merely unreferenced). Device blocks only: a
prefix whose next blocks sit in the offload tier is pinned up to them. Models with recurrent state or
sliding windows are refused (a window's blocks are not a prefix's: not done yet). Torch-free.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, Optional, Sequence

from pdserve.api.kv_transfer import KVPinnedFull
from pdserve.api.peer_pull import PeerPinRefused, PeerPinTicket
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.prefix import match_prefix
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan
from pdserve.pd.prefill import PrefillConnector

logger = logging.getLogger(__name__)

PEER_PIN_PREFIX = "peer-pin-"  # pin ids: never a client's request id (those are checked by the registry)


def peer_pull_problem(plan: KVGroupPlan) -> Optional[str]:
    """Why prefixes of `plan`'s KV cannot move between peers yet (None: full attention only, they can)."""
    kinds = sorted({type(group.spec).__name__ for group in plan.groups if not isinstance(group.spec, FullAttentionSpec)})
    if kinds:
        return f"peer pulls move full-attention KV only; this model has {', '.join(kinds)} groups"
    return None


def pin_peer_prefix(kv: KVCacheManager, connector: PrefillConnector, token_ids: Sequence[int],
                    count_pinned_tokens: Callable[[int], None] = lambda num_tokens: None) -> Optional[PeerPinTicket]:
    """Pin the longest prefix of `token_ids` whose blocks are in this worker's pool; None when it holds
    no block of it. Raises PeerPinRefused (model not supported) or KVPinnedFull (pin limit reached)."""
    problem = peer_pull_problem(kv.plan)
    if problem is not None:
        raise PeerPinRefused(problem)
    if not kv.enable_prefix_caching:
        return None
    block_hashes = hash_full_blocks(token_ids, kv.block_size, [])
    hit = match_prefix(kv.pool, kv.plan, block_hashes, len(block_hashes), kv.block_size)  # the pool only
    if hit.num_tokens == 0:
        return None
    num_blocks = hit.num_tokens // kv.block_size
    num_pinned = num_blocks * len(kv.plan.groups)
    if not connector.has_room_to_pin(num_pinned):
        connector.metrics.pinned_refusals.inc()
        raise KVPinnedFull(f"this worker holds {connector.num_pinned_blocks} blocks for other workers; "
                           f"{num_pinned} more would pass its limit: compute the prefix instead")
    pin_id = f"{PEER_PIN_PREFIX}{uuid.uuid4().hex}"
    if not kv.allocate_slots(pin_id, hit.num_tokens, 0, hit):  # takes references only, never a new block
        return None
    lease = connector.leases.pin(pin_id, num_pinned)  # no claimable ticket: the answer below is the only one
    connector.metrics.pinned_blocks.set(connector.num_pinned_blocks)
    count_pinned_tokens(hit.num_tokens)
    identity = connector.identity
    logger.info("peer pin %s: %d tokens (%d blocks) pinned for a peer (lease %.0fs)", pin_id, hit.num_tokens,
                num_pinned, connector.leases.lease_s)
    return PeerPinTicket(pin_id=pin_id, engine_id=identity.engine_id, epoch=identity.epoch, nonce=lease.nonce,
                         num_tokens=hit.num_tokens, block_size=kv.block_size,
                         block_ids=[list(ids) for ids in kv.block_ids(pin_id)],
                         block_hashes=[block_hash.hex() for block_hash in block_hashes[:num_blocks]],
                         lease_left_s=connector.leases.lease_s)
