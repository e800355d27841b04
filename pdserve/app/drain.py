"""Graceful drain on SIGTERM: stop taking work, let what is in flight finish, then exit.

Invariant: a prefill worker exits only once no block is pinned for a decode
worker (every pinned prefill was read, released or its lease ran out), so a
rolling restart never makes a decode worker read freed memory; a decode
worker finishes its running requests within the grace period. A second
signal exits at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import uvicorn

logger = logging.getLogger(__name__)


class Drainable:
    """What the drain needs of a worker's engine."""

    def start_drain(self) -> None: ...

    def is_drained(self) -> bool: ...

    def abort_all(self) -> None: ...


def drain(engine: Optional[Drainable], timeout_s: float, poll_s: float = 0.1) -> bool:
    """Block until the engine is drained or `timeout_s` passed; True when drained."""
    if engine is None:
        return True
    engine.start_drain()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.is_drained():
            logger.info("drained: no request in flight and no block pinned")
            return True
        time.sleep(poll_s)
    logger.warning("drain timed out after %.0fs; aborting what is left", timeout_s)
    engine.abort_all()
    return False


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains before shutting down, and
    that shuts down on its own (`died` = True) once the worker cannot serve any more."""

    def __init__(self, config: uvicorn.Config, engine: Callable[[], Optional[Drainable]], timeout_s: float,
                 is_alive: Callable[[], bool] = lambda: True):
        super().__init__(config)
        self._engine = engine
        self._timeout_s = timeout_s
        self._is_alive = is_alive
        self._draining = False
        self.died = False

    async def on_tick(self, counter: int) -> bool:
        # uvicorn ticks every 0.1 s; a worker that cannot serve exits so that
        # its orchestrator (or `pdserve up`) restarts it, after /live said so.
        if not self.died and not self._is_alive():
            self.died = True
            logger.critical("this worker cannot serve any more; exiting")
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self._draining:
            super().handle_exit(sig, frame)  # second signal: exit now
            return
        self._draining = True
        logger.info("signal %s: draining (readiness now false)", sig)
        threading.Thread(target=self._drain_then_exit, name="pdserve-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        drain(self._engine(), self._timeout_s)
        self.should_exit = True
