"""Peer hints: when the worker chosen to compute a request's prompt (a prefill worker, or a decode
worker that computes it itself: a decode-only leg) holds less of it than another worker of the proxy's
pools does (the KV index's prediction), tell the chosen one where the longer prefix is, so that it may
pull it instead of computing it (the worker decides: pdserve/pd/peer_admission.py). Prefill and decode
workers both lend: a decode worker holds what no prefill worker has, a conversation's answers.

Invariant: a hint names only a worker of the proxy's own pools, available now, by the internal listener
its own /load reports, whose predicted prefix (in its pool, or continued in its offload tier: the holder
loads that part back before it pins, pdserve/pd/peer_pins.py) is at least `margin_tokens` longer than
the chosen worker's (whose own tier counts as its own); the header is the proxy's own (leg requests
carry no client header, so a client can never aim a worker at an address), and the worker takes it
only with the internal token. `choose_peer_hint` is pure; `PeerHints` gathers its inputs in one instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import httpx
from prometheus_client import CollectorRegistry, Counter

from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint
from proxy.backends import Backend, BackendPool
from proxy.routing.kv_index import CachedPrefix

if TYPE_CHECKING:
    from proxy.client_request import ClientRequest
    from proxy.routing.kv_routing import KVRouting


@dataclass(frozen=True, slots=True)
class PeerView:
    """One other worker of the pool as a peer hint sees it."""

    host: str
    internal_port: Optional[int]  # None: it named no internal listener (never hinted)
    available: bool
    cached: Optional[CachedPrefix]


def choose_peer_hint(chosen: Optional[CachedPrefix], peers: Sequence[PeerView], margin_tokens: int) -> Optional[PeerHint]:
    """The peer holding the longest prefix (pool and tier), when it beats the chosen worker's by the margin;
    the hint's medium says whether part of it sits in the peer's offload tier."""
    own_tokens = chosen.num_tokens if chosen is not None else 0
    usable = [p for p in peers if p.available and p.internal_port is not None and p.cached is not None]
    if not usable:
        return None
    best = max(usable, key=lambda p: p.cached.num_tokens)  # type: ignore[union-attr]
    cached: CachedPrefix = best.cached  # type: ignore[assignment]  # never None in `usable`
    if cached.num_tokens <= 0 or cached.num_tokens - own_tokens < margin_tokens:
        return None
    return PeerHint(host=best.host, port=best.internal_port, num_tokens=cached.num_tokens,
                    medium="offload" if cached.num_offload_tokens else "device")


class PeerHints:
    """The hint header of a leg to `chosen` that computes the prompt, counted (`pdserve_proxy_peer_hints_total`)."""

    def __init__(self, kv: "KVRouting", pools: Sequence[BackendPool], margin_tokens: int,
                 registry: CollectorRegistry):
        self.kv = kv
        self.pools = pools  # every worker that may lend: the prefill pool and the decode pool
        self.margin_tokens = margin_tokens
        self.hints = Counter("pdserve_proxy_peer_hints_total",
                             "Legs that compute a prompt (prefill legs, decode-only legs) sent with a peer hint "
                             "(another worker holds more of the prompt).", registry=registry)
        self.hinted_tokens = Counter("pdserve_proxy_peer_hint_tokens_total",
                                     "Prompt tokens the peer hints named.", registry=registry)

    def headers_for(self, chosen: Backend, request: "ClientRequest") -> dict[str, str]:
        peers = [PeerView(httpx.URL(b.url).host, b.load.internal_port, b.is_available(),
                          self.kv.cached_prefix(b.url, request))
                 for pool in self.pools for b in pool.backends() if b.url != chosen.url]
        hint = choose_peer_hint(self.kv.cached_prefix(chosen.url, request), peers, self.margin_tokens)
        if hint is None:
            return {}
        self.hints.inc()
        self.hinted_tokens.inc(hint.num_tokens)
        return {PEER_HINT_HEADER: hint.to_header()}
