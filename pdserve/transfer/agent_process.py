"""The NIXL agent's own process: a fault in NIXL or UCX kills this process, not the engine.

Started by pdserve/transfer/agent_client.py (`python -m pdserve.transfer.agent_process FD NAME
PROGRESS_THREAD NIXL_API_MODULE`) with one end of a socket pair as FD. It creates the agent, says
("ready", backends) or ("failed", why), then answers one request at a time:

    engine process                         agent process
    ("map", start, len)           ----->   map the memfd (fd sent alongside) at start
    ("register", addr, len, mem)  ----->   register [addr, addr + len) of a mapped memfd
                                  <-----   ("ok", handle id)
    ("unmap", start)              ----->   drop the mapping (nothing registered in it any more)
    ("check", xfer id)            ----->   agent.check_xfer_state(...)
                                  <-----   ("ok", "PROC" | "DONE" | "ERR")
    ("read", ReadSpec, settle_s)  ----->   make the READ, transfer, settle (pdserve/transfer/read_steps.py)
                                  <-----   ("ok", (xfer id, status, released, error))
    ("check_read", xfer id)       ----->   check; released here once DONE or ERR
                                  <-----   ("ok", (status, released))
    ("self_progress", interval_s) ----->   progress the agent that often between requests (0: never)

A mapping is known by its start address and its memfd's inode: memory freed in the engine and
allocated anew at the same address is another memfd, which the engine maps only after unmapping
the old one here (a read into the stale mapping would land where the engine never looks).

NIXL objects (registrations, descriptor lists, transfers) stay here, named to the engine by
integer ids. An exception answers ("err", repr); a crash closes the socket, which the engine
sees. The process exits when the engine's end of the socket closes, which includes the engine's
death (not PR_SET_PDEATHSIG: that fires when the thread that started the process ends, and
workers start their agent from a loader thread).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any, Callable

from pdserve.kv.shared_memory import map_at, unmap_at
from pdserve.transfer.read_steps import ReadSpec, check_read_steps, check_settle_s, start_read_steps

_PARENT_CHECK_S = 1.0
# While the engine called within ACTIVE_WINDOW_S, the process progresses its agent itself every
# SELF_PROGRESS_INTERVAL_S between requests (notifications it gathers wait for the next "notifs"):
# a peer's READ that carries a notification finishes only when this agent progresses, which the
# engine does only between its steps (measured: a 1-page pull 6.5 ms with the serving side polled
# every 5 ms, 1.2 ms every 0.5 ms; docs/benchmarks.md, "NIXL agent isolation").
SELF_PROGRESS_INTERVAL_S = 0.001  # the default; ("self_progress", 0) turns it off
MAX_SELF_PROGRESS_INTERVAL_S = 0.1
ACTIVE_WINDOW_S = 0.25  # an idle engine calls about once a second: its agent mostly rests


class AgentServer:
    """The requests the engine's `IsolatedAgent` sends, served by one nixl_agent."""

    def __init__(self, agent: Any, receive_fd: Callable[[], int]):
        self.agent = agent
        self._receive_fd = receive_fd
        self._objects: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._mapped: dict[int, tuple[int, int]] = {}  # start -> (length, memfd inode)
        self._gathered: dict[str, list[bytes]] = {}  # notifications `progress` took, not yet asked for
        self.self_progress_s = SELF_PROGRESS_INTERVAL_S

    def progress(self) -> None:
        """Progress the agent between requests, keeping what notifications it brings."""
        for name, messages in self.agent.get_new_notifs().items():
            self._gathered.setdefault(name, []).extend(messages)

    def _keep(self, value: Any) -> int:
        object_id = next(self._ids)
        self._objects[object_id] = value
        return object_id

    def handle(self, op: str, args: tuple) -> Any:
        method = getattr(self, f"op_{op}", None)
        if method is None:
            raise ValueError(f"unknown request {op!r}")
        return method(*args)

    def op_map(self, start: int, length: int) -> None:
        fd = self._receive_fd()
        try:
            identity = (length, os.fstat(fd).st_ino)
            mapped = self._mapped.get(start)
            if mapped is None:
                map_at(fd, start, length)
                self._mapped[start] = identity
            elif mapped != identity:
                raise ValueError(f"{start:#x} still maps memfd inode {mapped[1]} ({mapped[0]} bytes), not inode "
                                 f"{identity[1]} ({length} bytes): unmap it first")
        finally:
            os.close(fd)  # the mapping keeps the memory

    def op_unmap(self, start: int) -> None:
        mapped = self._mapped.pop(start, None)
        if mapped is not None:
            unmap_at(start, mapped[0])

    def op_register(self, address: int, length: int, mem_type: str, device_id: int) -> int:
        return self._keep(self.agent.register_memory([(address, length, device_id, "")], mem_type))

    def op_deregister(self, object_id: int) -> None:
        self.agent.deregister_memory(self._objects.pop(object_id))

    def op_metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def op_add_remote(self, metadata: bytes) -> Any:
        return self.agent.add_remote_agent(metadata)

    def op_remove_remote(self, name: str) -> None:
        self.agent.remove_remote_agent(name)

    def op_prep_dlist(self, agent_name: str, descs: Any, mem_type: str) -> int:
        return self._keep(self.agent.prep_xfer_dlist(agent_name, descs, mem_type))

    def op_release(self, object_id: int) -> None:
        self._objects.pop(object_id).release()

    def op_init_xfer(self, op: str, local: Any, local_mem: str, remote: Any, remote_mem: str, remote_name: str,
                     notification: bytes) -> int:
        return self._keep(self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, local_mem),
                                                     self.agent.get_xfer_descs(remote, remote_mem),
                                                     remote_name, notification))

    def op_prepped_xfer(self, op: str, local_dlist: int, local_ids: Any, remote_dlist: int, remote_ids: Any,
                        notification: bytes) -> int:
        return self._keep(self.agent.make_prepped_xfer(op, self._objects[local_dlist], local_ids,
                                                       self._objects[remote_dlist], remote_ids, notification))

    def op_transfer(self, object_id: int) -> str:
        return self.agent.transfer(self._objects[object_id])

    def op_check(self, object_id: int) -> str:
        return self.agent.check_xfer_state(self._objects[object_id])

    def op_read(self, spec: ReadSpec, settle_s: float) -> tuple[int, str, bool, str]:
        """A READ in one request: its id here (0 once released: it finished), status, released, error."""
        if spec.prepped:
            spec = dataclasses.replace(spec, local=self._objects[spec.local], remote=self._objects[spec.remote])
        xfer, status, released, error = start_read_steps(self.agent, spec, check_settle_s(settle_s))
        return (0 if released else self._keep(xfer), status, released, error)

    def op_check_read(self, object_id: int) -> tuple[str, bool]:
        status, released = check_read_steps(self.agent, self._objects[object_id])
        if released:
            del self._objects[object_id]
        return status, released

    def op_self_progress(self, interval_s: float) -> None:
        if not 0.0 <= interval_s <= MAX_SELF_PROGRESS_INTERVAL_S:
            raise ValueError(f"a self-progress interval of {interval_s!r} s (0 to {MAX_SELF_PROGRESS_INTERVAL_S})")
        self.self_progress_s = interval_s

    def op_notifs(self) -> dict:
        self.progress()
        gathered, self._gathered = self._gathered, {}
        return gathered

    def op_send_notif(self, name: str, payload: bytes) -> None:
        self.agent.send_notif(name, payload)


def serve(connection: Connection, server: AgentServer, clock: Callable[[], float] = time.monotonic) -> None:
    parent, last_request_s = os.getppid(), clock()
    while True:
        try:
            while True:
                active = server.self_progress_s > 0 and clock() - last_request_s < ACTIVE_WINDOW_S
                if connection.poll(server.self_progress_s if active else _PARENT_CHECK_S):
                    break
                if os.getppid() != parent:
                    return  # orphaned (the engine's process died without closing its end)
                if active:
                    try:
                        server.progress()
                    except Exception:  # the engine's next call meets the failure; stop until it calls
                        last_request_s = clock() - ACTIVE_WINDOW_S
            op, args = connection.recv()
            last_request_s = clock()
        except (EOFError, OSError):
            return  # the engine closed its end or died
        if op == "close":
            connection.send(("ok", None))
            return
        try:
            reply = ("ok", server.handle(op, args))
        except Exception as exc:  # NIXL's binding errors share no base class
            reply = ("err", repr(exc))
        connection.send(reply)


def main(argv: list[str]) -> int:
    fd, name, progress_thread, api_module = int(argv[0]), argv[1], argv[2] == "1", argv[3]
    connection = Connection(fd)
    try:
        # nixl's own backend module, named by the engine (agent_client.py says why): never the engine's
        # nixl_transport, which would import torch here for nothing.
        nixl_api = importlib.import_module(api_module)
        agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=progress_thread,
                                                                      backends=["UCX"]))
    except Exception as exc:
        connection.send(("failed", repr(exc)))
        return 1
    connection.send(("ready", list(agent.backends)))
    serve(connection, AgentServer(agent, lambda: recv_handle(connection)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
