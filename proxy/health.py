"""Health and load polling: GET /load on every backend, every `interval_s`.

Invariant: a backend counts as healthy only after a poll saw it ready, and
stops counting after `unhealthy_after` consecutive failed polls; one slow
backend never delays the polls of the others (they run concurrently, each
under its own timeout). Workers without /load (404) are polled on /health.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import httpx

from proxy.backends import Backend, BackendPool, LoadReport
from proxy.config import HealthConfig

logger = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, pools: Sequence[BackendPool], config: HealthConfig):
        self._pools = pools
        self._config = config
        self._no_load_route: set[str] = set()  # backends that answered 404 on /load

    async def run_forever(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self._config.interval_s)

    async def poll_all(self) -> None:
        backends = [backend for pool in self._pools for backend in pool.backends()]
        await asyncio.gather(*(self.poll(backend) for backend in backends))
        for pool in self._pools:
            await pool.close_idle_retired()

    async def poll(self, backend: Backend) -> None:
        try:
            ready, load = await self._probe(backend)
        except (httpx.HTTPError, ValueError) as exc:
            ready, load = False, None
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            reason = "not ready"
        if ready:
            if not backend.healthy:
                logger.info("%s backend %s is ready", backend.role.value, backend.url)
            backend.healthy = True
            backend.num_failed_polls = 0
            if load is not None:
                backend.load = load
            return
        backend.num_failed_polls += 1
        if backend.healthy and backend.num_failed_polls >= self._config.unhealthy_after:
            logger.warning("%s backend %s is unhealthy (%s)", backend.role.value, backend.url, reason)
            backend.healthy = False

    async def _probe(self, backend: Backend) -> tuple[bool, LoadReport | None]:
        timeout = self._config.timeout_s
        if backend.url not in self._no_load_route:
            response = await backend.client.get("/load", timeout=timeout)
            if response.status_code == 404:
                self._no_load_route.add(backend.url)
            else:
                body = response.json() if response.status_code == 200 else {}
                body = body if isinstance(body, dict) else {}
                ready = response.status_code == 200 and body.get("ready", True) is True
                return ready, LoadReport.from_json(body) if ready else None
        response = await backend.client.get("/health", timeout=timeout)
        return response.status_code == 200, None
