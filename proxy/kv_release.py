"""Early release of a prefill's pinned KV: the proxy tells the prefill worker when no decode worker will read it.

Invariant: a release is sent only when no decode worker can be reading the
blocks — the decode leg was never sent, was refused before its connection
opened, or was answered with a non-200 (the decode worker ended the request) —
never after a decode leg that timed out or broke mid-way (the decode worker
may still be reading; it tells the prefill worker itself, or the lease
expires). A release names the pin by its request id and nonce (both from
P's kv_transfer_params): the prefill worker frees nothing for the id alone.
Releases run in the background: the client's answer never waits.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from proxy.backends import Backend
from proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

RELEASE_PATH = "/internal/kv/release"
# The pin's nonce too: the prefill worker frees nothing for a bare request id.
_RELEASE_FIELDS = ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")


@dataclass(slots=True)
class PrefillHold:
    """The KV one prefill leg left pinned, and whether a decode worker may be reading it right now."""

    backend: Backend
    params: dict[str, Any]
    decode_may_read: bool = False  # set while a decode leg is out, cleared when it was definitely answered


class KVReleaser:
    def __init__(self, metrics: ProxyMetrics, timeout_s: float):
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    def release_unless_read(self, hold: PrefillHold, request_id: str) -> None:
        """Free the hold's KV unless a decode worker may be reading it."""
        if hold.decode_may_read:
            return
        body = {key: hold.params.get(key) for key in _RELEASE_FIELDS}
        if not all(isinstance(value, str) and value for value in body.values()):
            self._metrics.kv_releases.labels("skipped").inc()  # not our wire format: its lease frees it
            return
        task = asyncio.get_running_loop().create_task(self._send(hold.backend, body, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, backend: Backend, body: dict[str, str], request_id: str) -> None:
        failure: Optional[str] = None
        try:
            response = await backend.internal_client.post(RELEASE_PATH, json=body, timeout=self._timeout_s)
            if response.status_code not in (202, 409):  # 409: the worker restarted, nothing is pinned
                failure = f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            failure = type(error).__name__
        if failure is None:
            self._metrics.kv_releases.labels("sent").inc()
            logger.info("request %s: asked %s to free its pinned KV", request_id, backend.url)
        else:
            self._metrics.kv_releases.labels("failed").inc()
            logger.warning("request %s: releasing its KV on %s failed (%s); the lease will free it",
                           request_id, backend.url, failure)

    async def aclose(self) -> None:
        """Let the releases under way finish (the app is stopping)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._timeout_s)
