"""When a NIXL agent process that died is replaced, and whether the replacement is up yet.

    alive --(process died)--> begin() --> starting --ready()--> setting up --prepare(agent) done--> alive
                                             |                      |  (on a helper thread)
                                             |  not up in start_timeout_s, died, or set-up failed or
                                             v  not done in set_up_timeout_s: back off 0.5, 1, 2 .. s
                                          waiting --(backoff over)--> starting

Nothing here blocks the engine thread, which calls `advance` once per step while the agent is
down: starting the process and polling it are quick, and registering memory with the new agent
(bounded by the agent calls' own timeouts, up to minutes where pages get pinned) runs on a helper
thread. Invariant: the agent being set up is used by that thread alone until its outcome is
taken by `advance`; one abandoned (timed out, or the restart closed) is closed by whichever side
comes last. Torch-free and nixl-free.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from pdserve.transfer.agent_client import AgentProcessDied

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_SET_UP_TIMEOUT_S = 300.0  # registering a pool pins it on RDMA transports; each call has its own bound
DEFAULT_MAX_BACKOFF_S = 30.0

RunInBackground = Callable[[Callable[[], None]], None]


def run_on_helper_thread(job: Callable[[], None]) -> None:
    threading.Thread(target=job, name="nixl-agent-set-up", daemon=True).start()


class _SetUp:
    """One replacement's set-up on the helper thread: its outcome, or that nobody will take it."""

    def __init__(self, agent: Any, started_s: float):
        self.agent = agent
        self.started_s = started_s
        self.lock = threading.Lock()
        self.outcome: Optional[tuple[bool, Any]] = None  # (True, prepared) or (False, the exception)
        self.abandoned = False

    def run(self, prepare: Callable[[Any], Any]) -> None:
        try:
            outcome: tuple[bool, Any] = (True, prepare(self.agent))
        except Exception as exc:  # NIXL's errors, a dead process, an address taken in the new process
            outcome = (False, exc)
        with self.lock:
            self.outcome, abandoned = outcome, self.abandoned
        if abandoned:
            self.agent.close()

    def abandon(self) -> None:
        """Nobody takes the outcome: close the agent now if the thread is done, else the thread will."""
        with self.lock:
            self.abandoned, finished = True, self.outcome is not None
        if finished:
            self.agent.close()


class AgentRestart:
    def __init__(self, clock: Callable[[], float] = time.monotonic, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S, set_up_timeout_s: float = DEFAULT_SET_UP_TIMEOUT_S,
                 run_in_background: RunInBackground = run_on_helper_thread):
        self._clock = clock
        self._start_timeout_s = start_timeout_s
        self._set_up_timeout_s = set_up_timeout_s
        self._max_backoff_s = max_backoff_s
        self._run_in_background = run_in_background
        self._starting: Any = None
        self._started_s = 0.0
        self._set_up: Optional[_SetUp] = None
        self._next_s: Optional[float] = None  # when to start the next one; None: nothing to replace
        self._failures = 0

    def begin(self) -> None:
        """The agent died: start a replacement at the next `advance`."""
        self._next_s = self._clock()

    def advance(self, new_agent: Callable[[str], Any], name: str,
                prepare: Callable[[Any], Any]) -> Optional[tuple[Any, Any]]:
        """Start a replacement when due; once it is up and `prepare(agent)` (run on the helper
        thread) returned, (agent, what prepare returned) for the caller to install; else None."""
        if self._next_s is None:
            return None
        if self._set_up is None and not self._start_and_poll(new_agent, name, prepare):
            return None
        set_up = self._set_up
        with set_up.lock:
            outcome = set_up.outcome
        if outcome is None:
            if self._clock() - set_up.started_s > self._set_up_timeout_s:
                self._set_up = None
                set_up.abandon()
                self.failed(f"setting up the new NIXL agent took over {self._set_up_timeout_s:g} s")
            return None
        self._set_up = None
        succeeded, value = outcome
        if not succeeded:
            self.failed(f"setting up the new NIXL agent failed: {value!r}", set_up.agent)
            return None
        self._next_s, self._failures = None, 0
        return set_up.agent, value

    def _start_and_poll(self, new_agent: Callable[[str], Any], name: str, prepare: Callable[[Any], Any]) -> bool:
        """Start the process when due, poll it; True once it is up and its set-up was handed off."""
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
        set_up = self._set_up = _SetUp(self._starting, self._clock())
        self._starting = None
        self._run_in_background(lambda: set_up.run(prepare))
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
        if self._set_up is not None:
            self._set_up.abandon()
            self._set_up = None
        self._next_s = None
