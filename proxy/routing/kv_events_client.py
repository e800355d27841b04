"""Following the workers' KV event streams into the index, and fetching the routing info once.

Invariant: one subscription per backend of a kv_aware role while it is in its
pool; whatever ends a stream (error, lost events, the backend leaving) drops
that worker's blocks from the index before anything else happens, so routing
never trusts a history it could not follow; the next stream starts with a
snapshot, which also names the worker's block size (the index matches each
worker over its own; a snapshot without one is a broken stream). Reconnects
back off from 0.1 s to 1 s, so a restarted worker is followed again within a
second of serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional, Sequence

import httpx

from pdserve.kv.events_wire import EVENTS, HEARTBEAT, SNAPSHOT, KVWireError, decode_line
from pdserve.kv.routing_info import EVENTS_PATH, ROUTING_INFO_PATH, RoutingInfo
from proxy.backends import Backend, BackendPool
from proxy.routing.kv_index import KVIndex, SequenceGap
from proxy.routing.kv_metrics import KVRoutingMetrics
from proxy.routing.kv_prompt import PromptHasher

logger = logging.getLogger(__name__)

MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0
STREAM_READ_TIMEOUT_S = 5.0  # workers send a heartbeat every second
SYNC_INTERVAL_S = 0.5  # how often subscriptions follow pool changes
INFO_RETRY_S = 1.0


class KVEventSubscription:
    """One backend's stream into the index, reconnecting until cancelled."""

    def __init__(self, backend: Backend, index: KVIndex, metrics: KVRoutingMetrics):
        self.backend = backend
        self._index = index
        self._metrics = metrics
        self._role = backend.role.value
        self._snapshot_reason = "connect"
        self._last_epoch: Optional[str] = None
        self._synced = False  # the current stream's snapshot was applied

    async def run_forever(self) -> None:
        backoff_s = MIN_BACKOFF_S
        try:
            while True:
                self._synced = False
                try:
                    await self._follow()
                    self._snapshot_reason = "stream"
                except SequenceGap as exc:
                    logger.warning("KV events of %s: %s; resyncing", self.backend.url, exc)
                    self._snapshot_reason = "gap"
                except (httpx.HTTPError, KVWireError, OSError) as exc:
                    logger.debug("KV events of %s: %s", self.backend.url, exc)
                    self._snapshot_reason = "stream"
                self._index.drop_worker(self.backend.url)
                backoff_s = MIN_BACKOFF_S if self._synced else min(MAX_BACKOFF_S, backoff_s * 2)
                await asyncio.sleep(backoff_s)
        finally:
            self._index.drop_worker(self.backend.url)

    async def _follow(self) -> None:
        """Read one stream to its end."""
        timeout = httpx.Timeout(STREAM_READ_TIMEOUT_S, connect=STREAM_READ_TIMEOUT_S)
        async with self.backend.internal_client.stream("GET", EVENTS_PATH, timeout=timeout) as response:
            if response.status_code != 200:
                await response.aread()
                logger.debug("KV events of %s: HTTP %d", self.backend.url, response.status_code)
                return
            async for line in response.aiter_lines():
                if line:
                    self._apply(line.encode())

    def _apply(self, line: bytes) -> None:
        message = decode_line(line)
        url = self.backend.url
        if message.type == SNAPSHOT:
            if message.block_size < 1:
                raise KVWireError(f"a snapshot of blocks of {message.block_size} tokens")
            self._index.apply_snapshot(url, self._role, message.epoch, message.seq, message.block_size,
                                       message.blocks)
            restarted = self._last_epoch is not None and self._last_epoch != message.epoch
            reason = "restart" if restarted else self._snapshot_reason
            self._last_epoch = message.epoch
            self._synced = True
            self._metrics.resyncs.labels(self._role, reason).inc()
            logger.info("KV index: %s has %d cached blocks of %d tokens (epoch %s, %s)", url, len(message.blocks),
                        message.block_size, message.epoch, reason)
            return
        if message.type == EVENTS:
            self._index.apply_events(url, message.epoch, message.events)
            self._metrics.events_applied.labels(self._role).inc(len(message.events))
        elif message.type == HEARTBEAT:
            self._index.check_heartbeat(url, message.epoch, message.seq)


class KVEventSubscriptions:
    """Keeps one subscription per backend of the given pools, following discovery."""

    def __init__(self, pools: Sequence[BackendPool], index: KVIndex, metrics: KVRoutingMetrics):
        self._pools = pools
        self._index = index
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task] = {}

    def sync(self) -> None:
        backends = {b.url: b for pool in self._pools for b in pool.backends()}
        for url in [u for u in self._tasks if u not in backends]:
            self._tasks.pop(url).cancel()
        for url, backend in backends.items():
            task = self._tasks.get(url)
            if task is None or task.done():
                subscription = KVEventSubscription(backend, self._index, self._metrics)
                self._tasks[url] = asyncio.create_task(subscription.run_forever(), name=f"kv-events {url}")

    async def run_forever(self) -> None:
        try:
            while True:
                self.sync()
                await asyncio.sleep(SYNC_INTERVAL_S)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._tasks.clear()


async def fetch_prompt_hasher(list_backends: Callable[[], list[Backend]],
                              timeout_s: float = 10.0) -> PromptHasher:
    """Ask the workers for their routing info until one answers, and build the hasher from it
    (deserializing a tokenizer takes a noticeable fraction of a second: off the event loop)."""
    while True:
        for backend in list_backends():
            hasher = await _try_fetch(backend, timeout_s)
            if hasher is not None:
                return hasher
        await asyncio.sleep(INFO_RETRY_S)


async def _try_fetch(backend: Backend, timeout_s: float) -> Optional[PromptHasher]:
    try:
        response = await backend.internal_client.get(ROUTING_INFO_PATH, timeout=timeout_s)
        if response.status_code != 200:
            logger.debug("routing info of %s: HTTP %d", backend.url, response.status_code)
            return None
        info = RoutingInfo.model_validate_json(response.content)
        hasher = await asyncio.to_thread(PromptHasher, info)
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("routing info of %s unusable: %s", backend.url, exc)
        return None
    logger.info("KV-aware routing: %s's tokenizer and chat template loaded (block size %d, %d KV groups)",
                backend.url, hasher.block_size, len(hasher.plan.groups))
    return hasher
