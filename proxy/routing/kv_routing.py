"""KV-aware routing for the forwarder: a request's prompt blocks, each candidate's cached prefix,
the choice, cache-aware disaggregation, and the check of every prediction against the worker's answer.

Invariant: routing by cache never fails a request: without the prompt's
blocks (tokenizer not fetched yet, a request the worker will reject) the role
falls back to least_loaded; the prefill leg is skipped only when the chosen
decode worker's cache leaves at most `kv_decode_only_max_tokens` prompt tokens
for it to compute. Each candidate's cached prefix is matched over that
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
from proxy.routing.kv_index import KVIndex
from proxy.routing.kv_metrics import KVRoutingMetrics
from proxy.routing.kv_prompt import KVRoute, PromptBlocks, PromptHasher
from proxy.routing.policies import LeastLoadedPolicy
from proxy.routing.policies_kv import NO_BLOCKS, KVAwarePolicy, ScoredCandidate, rank, reason_for, score_candidate

if TYPE_CHECKING:
    from proxy.client_request import ClientRequest

logger = logging.getLogger(__name__)

KV_AWARE = "kv_aware"
SKIPPED_DECODE_CACHED = "skipped_decode_cached"


class KVRouting:
    def __init__(self, config: RoutingConfig, pools: dict[Role, BackendPool], registry: CollectorRegistry):
        self._config = config
        self._pools = pools
        self.index = KVIndex()
        self.metrics = KVRoutingMetrics(registry, self.index)
        self.hasher: Optional[PromptHasher] = None
        names = {Role.PREFILL: config.prefill_policy, Role.DECODE: config.decode_policy}
        self._policies = {role: KVAwarePolicy() for role, name in names.items() if name == KV_AWARE}
        self._fallback = {role: LeastLoadedPolicy() for role in self._policies}
        self._subscriptions = KVEventSubscriptions([pools[role] for role in self._policies], self.index, self.metrics)

    def handles(self, role: Role) -> bool:
        return role in self._policies

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

    def choose(self, role: Role, candidates: Sequence[Backend], request: "ClientRequest") -> Backend:
        route: Optional[KVRoute] = request.kv_route
        hasher = self.hasher
        if route is None or route.blocks is None or hasher is None:
            self.metrics.decisions.labels(role.value, NO_BLOCKS).inc()
            return self._fallback[role].choose(candidates, b"")
        choice, reason = self._policies[role].choose(self._score(candidates, route.blocks, hasher))
        route.predicted[choice.backend.url] = choice.cached_tokens
        self.metrics.decisions.labels(role.value, reason).inc()
        logger.debug("request %s: %s -> %s (%s, %d of %d tokens cached, %d of them in its offload tier)",
                     request.request_id, role.value, choice.backend.url, reason, choice.cached_tokens,
                     route.blocks.num_tokens, choice.offload_tokens)
        return choice.backend

    def skips_prefill(self, request: "ClientRequest", decode: Backend) -> bool:
        """Cache-aware disaggregation: the decode worker holds all but a few of the prompt's tokens."""
        route: Optional[KVRoute] = request.kv_route
        if route is None or route.blocks is None or decode.url not in route.predicted:
            return False
        if not self._decode_alone_suffices(route.blocks.num_tokens, route.predicted[decode.url]):
            return False
        self.metrics.decisions.labels(Role.PREFILL.value, SKIPPED_DECODE_CACHED).inc()
        return True

    def _decode_alone_suffices(self, num_prompt_tokens: int, cached_tokens: int) -> bool:
        limit = self._config.kv_decode_only_max_tokens
        return limit > 0 and cached_tokens > 0 and num_prompt_tokens - cached_tokens <= limit

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
        answer["skip_prefill"] = self.handles(Role.DECODE) and bool(best_decode) and self._decode_alone_suffices(
            blocks.num_tokens, best_decode[0]["cached_tokens"])
        return answer

    def _explained(self, candidate: ScoredCandidate) -> dict[str, Any]:
        """The candidate's score, and the block size its prefix was matched over (None: not in the index)."""
        worker = self.index.worker(candidate.backend.url)
        return {**candidate.as_dict(), "block_size": worker.block_size if worker is not None else None}
