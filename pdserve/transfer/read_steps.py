"""The steps of one KV READ where its NIXL agent lives: create, start, settle, and release once finished.

NixlTransport starts and checks every read through an object with `start_read(spec, settle_s)` and
`check_read(read)`. Where the agent lives in another process (pdserve/transfer/agent_client.py)
the steps run there, one request each way per start and per check:

    stepwise (StepwiseReads)                 single (IsolatedAgent, LocalReads)
    make_prepped_xfer | initialize_xfer ->   ("read", spec, settle_s)  -> start_read_steps
    transfer                            ->        <- (xfer id, status, released, error)
    check_xfer_state   (per poll)       ->   ("check_read", xfer id)   -> check_read_steps
    release                             ->        <- (status, released)   released at DONE/ERR

Invariant: a read is released exactly once, by whoever sees it finish: `start_read_steps` and
`check_read_steps` release it at DONE or ERR (a release NIXL refuses leaves `released` False and the
engine's `Read.release` tries again); `Read.release` is a no-op once released. Settling (checking
for up to `settle_s`, at most MAX_SETTLE_S, before answering) lets a small pull answer DONE in the
first reply; the engine thread waits for that answer, so MAX_SETTLE_S bounds what one read can add
to anyone's step. Torch-free and nixl-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

FINISHED = ("DONE", "ERR")
MAX_SETTLE_S = 0.005  # the longest an agent may progress a new read before answering (one engine poll)
# Measured (docs/benchmarks.md, "NIXL agent isolation"): a 1-page pull answered DONE in the first reply
# 149 times in 150 with it, against 80 without (whose next check comes an engine poll, 5 ms, later).
DEFAULT_SETTLE_S = 0.002
READ_OPS = ("single", "stepwise")


@dataclass(frozen=True, slots=True)
class ReadSpec:
    """One READ: prepared lists and indices (`local_ids` set), or descriptor arrays with memory types."""

    local: Any  # a prepared descriptor list, or an (n, 3) descriptor array
    remote: Any
    remote_name: str
    notification: bytes
    local_ids: Any = None  # with prepared lists: the indices into each
    remote_ids: Any = None
    local_mem: str = "DRAM"
    remote_mem: str = "DRAM"

    @property
    def prepped(self) -> bool:
        return self.local_ids is not None


@dataclass(slots=True)
class Read:
    """The engine's record of a started read: `xfer` is NIXL's handle, or the agent process's object."""

    xfer: Any
    status: str  # "PROC", "DONE" or "ERR", as last seen
    released: bool = False
    error: str = ""  # why it is ERR, when NIXL raised

    def release(self) -> None:
        if not self.released:
            self.xfer.release()
            self.released = True


def check_read_op(read_op: str) -> str:
    if read_op not in READ_OPS:
        raise ValueError(f"read_op must be one of {READ_OPS}, not {read_op!r}")
    return read_op


def check_settle_s(settle_s: float) -> float:
    if not 0.0 <= settle_s <= MAX_SETTLE_S:
        raise ValueError(f"settle_s must lie in [0, {MAX_SETTLE_S}] s, not {settle_s!r}")
    return settle_s


def make_xfer(agent: Any, spec: ReadSpec) -> Any:
    """The READ's transfer object, made by `agent` (a nixl_agent, or anything with its interface)."""
    if spec.prepped:
        return agent.make_prepped_xfer("READ", spec.local, spec.local_ids, spec.remote, spec.remote_ids,
                                       spec.notification)
    return agent.initialize_xfer("READ", agent.get_xfer_descs(spec.local, spec.local_mem),
                                 agent.get_xfer_descs(spec.remote, spec.remote_mem), spec.remote_name,
                                 spec.notification)


def start_read_steps(agent: Any, spec: ReadSpec, settle_s: float,
                     clock: Callable[[], float] = time.monotonic) -> tuple[Any, str, bool, str]:
    """Make the READ, start it, check it for up to `settle_s` while PROC, release it once finished:
    (xfer, status, released, error). Making it may raise (nothing exists then); a raising transfer is ERR."""
    xfer = make_xfer(agent, spec)
    error = ""
    try:
        status = agent.transfer(xfer)
        deadline_s = clock() + settle_s
        while status == "PROC" and settle_s > 0 and clock() < deadline_s:
            status = agent.check_xfer_state(xfer)
    except Exception as exc:  # NIXL's binding errors share no base class
        status, error = "ERR", repr(exc)
    return (xfer, status, _release_if_finished(xfer, status), error)


def check_read_steps(agent: Any, xfer: Any) -> tuple[str, bool]:
    """The READ's state, and whether it was released here (it is once DONE or ERR)."""
    status = agent.check_xfer_state(xfer)
    return status, _release_if_finished(xfer, status)


def _release_if_finished(xfer: Any, status: str) -> bool:
    if status not in FINISHED:
        return False
    try:
        xfer.release()
    except Exception:  # NIXL refuses while it cannot cancel: the engine's release tries again
        return False
    return True


class LocalReads:
    """The single-request steps for an agent in this process (no round trips to save; same semantics)."""

    def __init__(self, agent: Any, clock: Callable[[], float] = time.monotonic):
        self.agent = agent
        self._clock = clock

    def start_read(self, spec: ReadSpec, settle_s: float) -> Read:
        xfer, status, released, error = start_read_steps(self.agent, spec, settle_s, self._clock)
        return Read(xfer, status, released, error)

    def check_read(self, read: Read) -> str:
        read.status, read.released = check_read_steps(self.agent, read.xfer)
        return read.status


class StepwiseReads:
    """Today's path before issue 38's single request: one agent call per step, released by the engine
    (`read_op="stepwise"`, kept to measure the difference)."""

    def __init__(self, agent: Any):
        self.agent = agent

    def start_read(self, spec: ReadSpec, settle_s: float) -> Read:
        read = Read(make_xfer(self.agent, spec), "PROC")
        try:
            read.status = self.agent.transfer(read.xfer)
        except Exception as exc:  # e.g. the peer disconnected after the request was made
            read.status, read.error = "ERR", repr(exc)
        return read

    def check_read(self, read: Read) -> str:
        read.status = self.agent.check_xfer_state(read.xfer)
        return read.status


def reads_of(agent: Any, read_op: str, isolated_type: type) -> Any:
    """What starts and checks reads on `agent`: the agent process itself (single), LocalReads, or StepwiseReads."""
    if read_op == "stepwise":
        return StepwiseReads(agent)
    return agent if isinstance(agent, isolated_type) else LocalReads(agent)


def parse_started(reply: Any) -> Optional[tuple[int, str, bool, str]]:
    """The agent process's answer to "read", or None when it has the wrong shape."""
    if (isinstance(reply, tuple) and len(reply) == 4 and isinstance(reply[0], int) and reply[1] in
            ("PROC", *FINISHED) and isinstance(reply[2], bool) and isinstance(reply[3], str)):
        return reply
    return None


def parse_checked(reply: Any) -> Optional[tuple[str, bool]]:
    """The agent process's answer to "check_read", or None when it has the wrong shape."""
    if isinstance(reply, tuple) and len(reply) == 2 and reply[0] in ("PROC", *FINISHED) and isinstance(reply[1], bool):
        return reply
    return None
