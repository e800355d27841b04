"""KV-aware routing's signals for the forwarder: a request's prompt blocks, each worker's cached
prefix (the KV index's prediction), the record of each kv_aware pick, and the check of every
prediction against the worker's answer. The choice itself is `proxy.routing.route.choose_route`'s.

Invariant: routing by cache never fails a request: without the prompt's
blocks (tokenizer not fetched yet, a request the worker will reject) the role
falls back to least_loaded. Each candidate's cached prefix is matched over that
worker's own block size (the index records it), so prefill and decode workers
with different block sizes are each predicted exactly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from prometheus_client import CollectorRegistry

from proxy.backends import Backend, BackendPool, Role
from proxy.config import RoutingConfig
from proxy.routing.kv_events_client import KVEventSubscriptions, fetch_prompt_hasher
from proxy.routing.candidates import Pick
from proxy.routing.kv_index import CachedPrefix, KVIndex
from proxy.routing.kv_metrics import KVRoutingMetrics
from proxy.routing.kv_prompt import KVRoute, PromptBlocks, PromptHasher
from proxy.routing.policies_kv import (KV_REASONS, ScoredCandidate, decode_alone_suffices, rank, reason_for,
                                       score_candidate)
from proxy.routing.route import SKIPPED_DECODE_CACHED

if TYPE_CHECKING:
    from proxy.client_request import ClientRequest

logger = logging.getLogger(__name__)

KV_AWARE = "kv_aware"


class KVRouting:
    def __init__(self, config: RoutingConfig, pools: dict[Role, BackendPool], registry: CollectorRegistry):
        self._config = config
        self._pools = pools
        self.index = KVIndex()
        self.metrics = KVRoutingMetrics(registry, self.index)
        self.hasher: Optional[PromptHasher] = None
        names = {Role.PREFILL: config.prefill_policy, Role.DECODE: config.decode_policy}
        self._roles = frozenset(role for role, name in names.items() if name == KV_AWARE)
        # Peer hints predict every worker's prefix, whatever the policies: a decode worker lends its
        # prefixes (the answers it decoded included) as a prefill worker does.
        followed = self._roles | ({Role.PREFILL, Role.DECODE} if config.peer_pull else set())
        self._subscriptions = KVEventSubscriptions([pools[role] for role in Role if role in followed],
                                                   self.index, self.metrics)

    def handles(self, role: Role) -> bool:
        return role in self._roles

    async def run_forever(self) -> None:
        """Follow the event streams; fetch the tokenizer and template once (lifespan task)."""
        follow = asyncio.create_task(self._subscriptions.run_forever(), name="kv-subscriptions")
        try:
            self.hasher = await fetch_prompt_hasher(self._all_available)
            await follow
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)

    def _all_available(self) -> list[Backend]:
        return [b for pool in self._pools.values() for b in pool.available()]

    # ---- per request -------------------------------------------------------------------

    async def prepare(self, request: "ClientRequest") -> None:
        blocks = None
        if self.hasher is not None:
            try:
                blocks = await self.hasher.prompt_blocks(request.path, request.body)
            except Exception:  # noqa: BLE001 - routing by cache must never fail a request
                logger.exception("request %s: computing its prompt blocks failed; routing by load",
                                 request.request_id)
        request.kv_route = KVRoute(blocks)

    def blocks_known(self, request: "ClientRequest") -> bool:
        return self.hasher is not None and request.kv_route is not None and request.kv_route.blocks is not None

    def cached_prefix(self, url: str, request: "ClientRequest") -> Optional[CachedPrefix]:
        """The index's prediction of the worker's prefix hit for this request; None without its blocks."""
        hasher = self.hasher
        if hasher is None or request.kv_route is None or request.kv_route.blocks is None:
            return None
        return self.index.cached_prefix(url, request.kv_route.blocks, hasher.plan)

    def record(self, role: Role, request: "ClientRequest", pick: Pick) -> None:
        """A kv_aware pick the forwarder executes: its reason counted, its prediction kept to be checked."""
        if pick.reason not in KV_REASONS:
            return  # not the policy's choice (the prefill worker the client named)
        self.metrics.decisions.labels(role.value, pick.reason).inc()
        route: Optional[KVRoute] = request.kv_route
        if pick.cached_tokens is None or route is None or route.blocks is None:
            return
        route.predicted[pick.url] = pick.cached_tokens
        logger.debug("request %s: %s -> %s (%s, %d of %d tokens cached)", request.request_id, role.value,
                     pick.url, pick.reason, pick.cached_tokens, route.blocks.num_tokens)

    def record_skipped_prefill(self) -> None:
        self.metrics.decisions.labels(Role.PREFILL.value, SKIPPED_DECODE_CACHED).inc()

    def observe(self, role: Role, request: "ClientRequest", backend: Backend, actual_cached_tokens: Optional[int]) -> None:
        """The worker's own count (usage.prompt_tokens_details.cached_tokens) against the prediction."""
        route: Optional[KVRoute] = request.kv_route
        if route is None or actual_cached_tokens is None or backend.url not in route.predicted:
            return
        predicted = route.predicted[backend.url]
        self.metrics.observe_prediction(role.value, predicted, actual_cached_tokens)
        if predicted != actual_cached_tokens:
            logger.info("request %s: %s %s reported %d cached tokens, the index predicted %d", request.request_id,
                        role.value, backend.url, actual_cached_tokens, predicted)

    def _score(self, candidates: Sequence[Backend], blocks: PromptBlocks,
               hasher: PromptHasher) -> list[ScoredCandidate]:
        """One KV group plan for all (it is the model's); each worker's hit over its own block size."""
        config = self._config
        return [score_candidate(backend, self.index.cached_prefix(backend.url, blocks, hasher.plan),
                                blocks.num_tokens, config.kv_load_tokens, config.kv_offload_hit_weight)
                for backend in candidates]

    # ---- debugging ---------------------------------------------------------------------

    async def explain(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Each candidate's score and block size for this body, and what kv_aware would do; changes nothing.
        The top-level `block_size` and `num_blocks` are those of the worker whose routing info was loaded."""
        hasher = self.hasher
        if hasher is None:
            return {"ready": False, "reason": "no worker has served its routing info yet"}
        blocks = await hasher.prompt_blocks(path, body)
        if blocks is None:
            return {"ready": True, "num_prompt_tokens": None, "reason": "the request is not one a worker accepts"}
        answer: dict[str, Any] = {"ready": True, "model": hasher.model, "block_size": hasher.block_size,
                                  "num_prompt_tokens": blocks.num_tokens,
                                  "num_blocks": len(blocks.block_hashes(hasher.block_size))}
        for role, pool in self._pools.items():
            scored = self._score(pool.available(), blocks, hasher)
            ranked = rank(scored)
            answer[role.value] = {
                "policy": KV_AWARE if self.handles(role) else "other",
                "candidates": [self._explained(c) for c in ranked],
                "choice": ranked[0].backend.url if ranked else None,
                "reason": reason_for(ranked[0], scored) if ranked else None,
            }
        best_decode = answer[Role.DECODE.value]["candidates"][:1]
        answer["skip_prefill"] = self.handles(Role.DECODE) and bool(best_decode) and decode_alone_suffices(
            blocks.num_tokens, best_decode[0]["cached_tokens"], self._config.kv_decode_only_max_tokens)
        return answer

    def _explained(self, candidate: ScoredCandidate) -> dict[str, Any]:
        """The candidate's score, and the block size its prefix was matched over (None: not in the index)."""
        worker = self.index.worker(candidate.backend.url)
        return {**candidate.as_dict(), "block_size": worker.block_size if worker is not None else None}
