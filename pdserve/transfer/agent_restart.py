"""When a NIXL agent process that died is replaced, and whether the replacement is up yet.

    alive --(process died)--> begin() --> starting --ready(), set_up(agent)--> alive
                                             |  not up in start_timeout_s, or died:
                                             v  failed(): back off 0.5, 1, 2 .. max_backoff_s s
                                          waiting --(backoff over)--> starting

Nothing here blocks: the engine thread calls `advance` once per step while the agent is down.
Torch-free and nixl-free.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from pdserve.transfer.agent_client import AgentProcessDied

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_MAX_BACKOFF_S = 30.0


class AgentRestart:
    def __init__(self, clock: Callable[[], float] = time.monotonic, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S):
        self._clock = clock
        self._start_timeout_s = start_timeout_s
        self._max_backoff_s = max_backoff_s
        self._starting: Any = None
        self._started_s = 0.0
        self._next_s: Optional[float] = None  # when to start the next one; None: nothing to replace
        self._failures = 0

    def begin(self) -> None:
        """The agent died: start a replacement at the next `advance`."""
        self._next_s = self._clock()

    def advance(self, new_agent: Callable[[str], Any], name: str, set_up: Callable[[Any], None]) -> bool:
        """Start a replacement when due; True once one is up and `set_up(agent)` succeeded."""
        if self._next_s is None:
            return False
        if self._starting is None:
            if self._clock() < self._next_s:
                return False
            try:
                self._starting, self._started_s = new_agent(name), self._clock()
            except Exception as exc:
                self.failed(f"cannot start a NIXL agent process: {exc!r}")
                return False
        try:
            ready = self._starting.ready()
        except AgentProcessDied as exc:
            self.failed(str(exc))
            return False
        if not ready:
            if self._clock() - self._started_s > self._start_timeout_s:
                self.failed(f"the new NIXL agent was not up within {self._start_timeout_s:g} s")
            return False
        agent, self._starting, self._next_s = self._starting, None, None
        try:
            set_up(agent)
        except Exception as exc:  # NIXL's errors, a dead process, an address taken in the new process
            self.failed(f"setting up the new NIXL agent failed: {exc!r}", agent)
            return False
        self._failures = 0
        return True

    def failed(self, reason: str, agent: Any = None) -> None:
        """The replacement (`agent`, or the one starting) failed: close it, try again after a backoff."""
        for dead in (agent, self._starting):
            if dead is not None:
                dead.close()
        self._starting = None
        self._failures += 1
        delay = min(self._max_backoff_s, 0.5 * 2 ** (self._failures - 1))
        self._next_s = self._clock() + delay
        logger.error("%s; next try in %.1f s", reason, delay)

    def close(self) -> None:
        if self._starting is not None:
            self._starting.close()
            self._starting = None
        self._next_s = None
