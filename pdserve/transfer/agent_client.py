"""`IsolatedAgent`: the part of nixl_agent's interface NixlTransport uses, served by a child process.

A segfault in NIXL or UCX (one was reproduced when a decode peer was SIGKILLed mid-READ:
docs/reliability.md, "The prefill crash") then kills the agent process, not the engine. Every
call is one request/answer over a socket pair (pdserve/transfer/agent_process.py; a KV read is
made and started in one, `start_read`, and released by the agent once a check sees it finish:
pdserve/transfer/read_steps.py); memory is shared by address (pdserve/kv/shared_memory.py), so
descriptors cross unchanged. The bound on a call is hard (pdserve/transfer/agent_wire.py): a
closed socket, no whole answer within `call_timeout_s` (an answer cut off halfway included), or a
malformed answer (the read ops' included) marks the agent dead, and its process is killed; the
wait for the killed process to exit is bounded too (`KILL_WAIT_S`: one stuck in the kernel is left
behind, named in the log). Every later call raises `AgentProcessDied`, and releasing its objects
(a `Read` included) is a no-op (a dead process writes no memory). NixlTransport then fails what
was in flight and starts a new agent.

Start-up does not block: the constructor starts the process; `ready()` says, without waiting,
whether the agent is up (it raises `AgentProcessDied` if it failed to start).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Callable, Optional

import numpy as np

from pdserve.api.child_process import child_environment, python_module_command
from pdserve.kv.shared_memory import region_of
from pdserve.transfer.agent_wire import AgentWireError, receive_within, send_within
from pdserve.transfer.read_steps import Read, ReadSpec, parse_checked, parse_started

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 5.0
KILL_WAIT_S = 5.0  # for a killed agent process to exit (one in uninterruptible sleep may not)
# Mapping and registering memory may pin it (RDMA transports pin every page): more time than a call.
REGISTER_TIMEOUT_S = 120.0


class AgentProcessDied(Exception):
    """The agent's process is gone (crashed, killed, or did not answer in time)."""


class AgentCallFailed(Exception):
    """NIXL raised inside the agent process; the message is its repr."""


class AddressTaken(AgentCallFailed):
    """The agent process's own (random) address space already uses the range a memfd must be mapped at:
    a fresh agent process, with another layout, can map it."""


@dataclass(slots=True)
class _Descriptors:
    """get_xfer_descs' result: kept here until a transfer sends it to the agent."""

    descs: Any
    mem_type: str


class _AgentObject:
    """A NIXL object living in the agent process (registration, descriptor list, transfer)."""

    __slots__ = ("agent", "object_id")

    def __init__(self, agent: "IsolatedAgent", object_id: int):
        self.agent = agent
        self.object_id = object_id

    def release(self) -> None:
        if self.agent.dead is None:
            self.agent.call("release", self.object_id)


class _Registration(_AgentObject):
    """A registration, and the start of the memfd mapping it lies in (unmapped with its last one)."""

    __slots__ = ("region_start",)

    def __init__(self, agent: "IsolatedAgent", object_id: int, region_start: int):
        super().__init__(agent, object_id)
        self.region_start = region_start


@dataclass(slots=True)
class _Mapping:
    """A memfd mapped in the agent process: by inode, since freed memory comes back at the same address."""

    length: int
    inode: int
    num_registrations: int = 0


def start_agent_process(fd: int, name: str, enable_prog_thread: bool, nixl_api_module: str) -> subprocess.Popen:
    """`python -P -m pdserve.transfer.agent_process` with `fd` (its end of the socket pair) passed on, in the
    trimmed environment of every pdserve child (pdserve/api/child_process.py)."""
    command = python_module_command("pdserve.transfer.agent_process", str(fd), name,
                                    "1" if enable_prog_thread else "0", nixl_api_module)
    env = child_environment({"PYTHONFAULTHANDLER": "1"})  # a crash leaves its stack in the worker's log
    return subprocess.Popen(command, pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)


class IsolatedAgent:
    def __init__(self, name: str, enable_prog_thread: bool = False,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, nixl_api_module: str = "nixl._api",
                 start_process: Callable[[int, str, bool, str], Any] = start_agent_process,
                 clock: Callable[[], float] = time.monotonic):
        """`start_process(fd, name, progress_thread, nixl_api_module)` starts the agent's process (a Popen,
        or a fake). `nixl_api_module`: the module the child takes nixl_agent from. The engine passes the
        backend module nixl chose in its own process (`nixl_cu13._api`, say), so that the child skips nixl's
        package import, which on a CPU-only torch imports all of torch to find no CUDA version (seconds
        of start-up and hundreds of MB of resident memory in every worker's agent process)."""
        self.name = name
        self._clock = clock
        self.call_timeout_s = call_timeout_s
        self.dead: Optional[str] = None
        self.backends: list[str] = []
        self._ready = False
        self._mapped: dict[int, _Mapping] = {}  # region start -> what the agent process maps there
        ours, theirs = socket.socketpair()
        try:
            self._process = start_process(theirs.fileno(), name, enable_prog_thread, nixl_api_module)
        finally:
            theirs.close()
        ours.setblocking(False)  # our end only: every wait is a poll with a deadline
        self._connection = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self._process.pid

    def ready(self) -> bool:
        """True once the agent is up; False while it starts; AgentProcessDied if it could not start."""
        if self._ready:
            return True
        if self.dead is not None:
            raise AgentProcessDied(self.dead)
        if not self._readable_within(0):
            if self._process.poll() is not None:
                self._die("exited while starting")
            return False
        try:
            reply = receive_within(self._connection.fileno(), self._clock() + self.call_timeout_s, self._clock)
        except AgentWireError as exc:
            self._die(f"exited while starting ({exc})")
        if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ready" and isinstance(reply[1], list)):
            self._die(f"could not create the NIXL agent: {reply!r:.300}")
        self.backends, self._ready = reply[1], True
        return True

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready and not self._readable_within(timeout_s):
            self._die(f"not up within {timeout_s:g} s")
        if not self.ready():
            self._die("not up")

    def _readable_within(self, timeout_s: float) -> bool:
        poller = select.poll()
        poller.register(self._connection.fileno(), select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))

    def call(self, op: str, *args: Any, fd: Optional[int] = None, timeout_s: Optional[float] = None) -> Any:
        if self.dead is not None:
            raise AgentProcessDied(self.dead)
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline_s = self._clock() + timeout_s
        try:
            send_within(self._connection.fileno(), (op, args), deadline_s, self._clock)
            if fd is not None:
                send_handle(self._connection, fd, self._process.pid)
            reply = receive_within(self._connection.fileno(), deadline_s, self._clock)
        except (AgentWireError, OSError) as exc:
            self._die(f"gave no whole answer to {op!r} (bound {timeout_s:g} s): {exc}")
        if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] in ("ok", "err")) or \
                (reply[0] == "err" and not isinstance(reply[1], str)):
            self._die(f"answered {op!r} with a malformed reply {reply!r:.200}")
        kind, value = reply
        if kind == "err":
            raise AgentCallFailed(value)
        return value

    def _die(self, reason: str) -> None:
        """Mark the agent dead (killing its process if still there) and raise AgentProcessDied."""
        if self.dead is None:
            self.dead = f"NIXL agent process {self._process.pid} {reason} ({self._kill_and_reap()})"
            self._connection.close()
        raise AgentProcessDied(self.dead)

    def _kill_and_reap(self) -> str:
        """Kill the process if it still runs and wait at most KILL_WAIT_S for it: how it ended."""
        if self._process.poll() is None:
            self._process.kill()
        try:
            code = self._process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.error("NIXL agent process %d did not exit within %g s of SIGKILL: left behind",
                         self._process.pid, KILL_WAIT_S)
            return f"still there {KILL_WAIT_S:g} s after SIGKILL"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    # ---- nixl_agent's interface ------------------------------------------------------------

    def register_memory(self, memory: Any, mem_type: Optional[str] = None) -> _Registration:
        """Register a host tensor (torch) that lies in pdserve shared memory.

        The agent maps the tensor's memfd first unless it maps that very memfd (same inode) there
        already; a mapping of freed memory left at the address (no registration in it) is dropped."""
        if getattr(memory, "is_cuda", False):
            raise AgentCallFailed("an isolated NIXL agent registers host memory only")
        address, length = memory.data_ptr(), memory.numel() * memory.element_size()
        region = region_of(address, length)
        inode = os.fstat(region.fd).st_ino
        mapping = self._mapped.get(region.start)
        if mapping is not None and (mapping.inode, mapping.length) != (inode, region.length):
            if mapping.num_registrations:
                raise AgentCallFailed(f"memory at {region.start:#x} is another memfd than the one still "
                                      f"registered there ({mapping.num_registrations} registrations)")
            self._unmap(region.start)
            mapping = None
        if mapping is None:
            try:
                self.call("map", region.start, region.length, fd=region.fd, timeout_s=REGISTER_TIMEOUT_S)
            except AgentCallFailed as exc:  # the agent answers an exception's repr: parsed here, once
                if str(exc).startswith("FileExistsError("):
                    raise AddressTaken(str(exc)) from exc
                raise
            mapping = self._mapped[region.start] = _Mapping(region.length, inode)
        object_id = self.call("register", address, length, "DRAM", 0, timeout_s=REGISTER_TIMEOUT_S)
        mapping.num_registrations += 1
        return _Registration(self, object_id, region.start)

    def deregister_memory(self, registration: _Registration) -> None:
        """Deregister; the last registration in a mapping unmaps it in the agent (issue 36: a buffer
        allocated later at the same address must not meet the old memory there)."""
        if self.dead is not None:
            return
        self.call("deregister", registration.object_id)
        mapping = self._mapped.get(registration.region_start)
        if mapping is not None:
            mapping.num_registrations -= 1
            if mapping.num_registrations <= 0:
                self._unmap(registration.region_start)

    def _unmap(self, start: int) -> None:
        self._mapped.pop(start, None)
        self.call("unmap", start)

    def get_agent_metadata(self) -> bytes:
        return self.call("metadata")

    def add_remote_agent(self, metadata: bytes) -> Any:
        return self.call("add_remote", metadata)

    def remove_remote_agent(self, name: str) -> None:
        self.call("remove_remote", name)

    def prep_xfer_dlist(self, agent_name: str, descs: Any, mem_type: str) -> _AgentObject:
        return _AgentObject(self, self.call("prep_dlist", agent_name, _portable(descs), mem_type))

    def get_xfer_descs(self, descs: Any, mem_type: str) -> _Descriptors:
        return _Descriptors(_portable(descs), mem_type)

    def initialize_xfer(self, op: str, local: _Descriptors, remote: _Descriptors, remote_name: str,
                        notification: bytes = b"") -> _AgentObject:
        return _AgentObject(self, self.call("init_xfer", op, local.descs, local.mem_type, remote.descs,
                                            remote.mem_type, remote_name, notification))

    def make_prepped_xfer(self, op: str, local_dlist: _AgentObject, local_ids: Any, remote_dlist: _AgentObject,
                          remote_ids: Any, notification: bytes = b"") -> _AgentObject:
        return _AgentObject(self, self.call("prepped_xfer", op, local_dlist.object_id, _portable(local_ids),
                                            remote_dlist.object_id, _portable(remote_ids), notification))

    def transfer(self, xfer: _AgentObject) -> str:
        return self.call("transfer", xfer.object_id)

    def check_xfer_state(self, xfer: _AgentObject) -> str:
        return self.call("check", xfer.object_id)

    # ---- reads in one request each (pdserve/transfer/read_steps.py) ----------------------

    def start_read(self, spec: ReadSpec, settle_s: float) -> Read:
        """Make, start and (for up to `settle_s`) progress a READ in one call; finished, the agent released it."""
        if spec.prepped:
            spec = dataclasses.replace(spec, local=spec.local.object_id, remote=spec.remote.object_id,
                                       local_ids=_portable(spec.local_ids), remote_ids=_portable(spec.remote_ids))
        else:
            spec = dataclasses.replace(spec, local=_portable(spec.local), remote=_portable(spec.remote))
        reply = self.call("read", spec, settle_s)
        started = parse_started(reply)
        if started is None:
            self._die(f"answered 'read' with a malformed reply {reply!r:.200}")
        object_id, status, released, error = started
        return Read(_AgentObject(self, object_id), status, released, error)

    def check_read(self, read: Read) -> str:
        """The read's state; the agent released it if DONE or ERR (then `read.release()` sends nothing)."""
        reply = self.call("check_read", read.xfer.object_id)
        checked = parse_checked(reply)
        if checked is None:
            self._die(f"answered 'check_read' with a malformed reply {reply!r:.200}")
        read.status, read.released = checked
        return read.status

    def set_self_progress(self, interval_s: float) -> None:
        """How often the process progresses its agent between requests while the engine is active
        (pdserve/transfer/agent_process.py, SELF_PROGRESS_INTERVAL_S); 0 turns it off."""
        self.call("self_progress", interval_s)

    def get_new_notifs(self) -> dict:
        return self.call("notifs")

    def send_notif(self, remote_name: str, payload: bytes) -> None:
        self.call("send_notif", remote_name, payload)

    def close(self) -> None:
        """Stop the agent process (it deregisters nothing: its memory goes with it)."""
        if self.dead is None:
            try:
                self.call("close")
            except (AgentProcessDied, AgentCallFailed):
                pass
            try:
                self._process.wait(timeout=self.call_timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_and_reap()
            self.dead = f"NIXL agent process {self._process.pid} closed"
            self._connection.close()


def _portable(value: Any) -> Any:
    """numpy arrays and lists pickle as they are; anything else array-like becomes a numpy array."""
    if isinstance(value, (np.ndarray, list, tuple)):
        return value
    return np.asarray(value)
