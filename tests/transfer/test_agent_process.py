"""The agent process's mappings (pdserve/transfer/agent_process.py), in this process with a fake
NIXL agent: a mapping is known by start address and memfd inode, another memfd at a mapped start
is refused until the old one is unmapped (issue 36 item 4: reads landed in freed memory)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from pdserve.kv.shared_memory import MEMFD_NAME
from pdserve.transfer.agent_process import AgentServer

LENGTH = 1 << 16


def memfd_holding(byte: int) -> int:
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(fd, LENGTH)
    os.pwrite(fd, bytes([byte]) * 16, 0)
    return fd


def free_address() -> int:
    """An address nothing maps now (the agent's mappings go there)."""
    probe = mmap.mmap(-1, LENGTH)
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    probe.close()
    return address


def test_another_memfd_at_a_mapped_start_is_refused_until_unmapped():
    fds = []
    server = AgentServer(agent=None, receive_fd=lambda: os.dup(fds.pop(0)))
    old, new = memfd_holding(1), memfd_holding(2)
    start = free_address()
    try:
        fds.append(old)
        server.op_map(start, LENGTH)
        assert ctypes.string_at(start, 4) == b"\x01" * 4
        fds.append(old)
        server.op_map(start, LENGTH)  # the same memfd again: nothing to do
        fds.append(new)
        with pytest.raises(ValueError, match="unmap it first"):
            server.op_map(start, LENGTH)
        server.op_unmap(start)
        fds.append(new)
        server.op_map(start, LENGTH)
        assert ctypes.string_at(start, 4) == b"\x02" * 4  # the new memory, not the old
    finally:
        server.op_unmap(start)
        os.close(old)
        os.close(new)


# ---- issue 38: reads in one request, released here once finished; progress between requests -------


class FakeXfer:
    def __init__(self, refuse_release: bool = False):
        self.refuse_release, self.num_releases = refuse_release, 0

    def release(self):
        if self.refuse_release:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.num_releases += 1


class FakeNixl:
    """nixl_agent's read calls: `states` are what transfer, then each check, answer."""

    def __init__(self, states, refuse_release=False, transfer_raises=False):
        self.states, self.refuse_release, self.transfer_raises = list(states), refuse_release, transfer_raises
        self.made, self.num_checks, self.num_notif_calls = [], 0, 0
        self.progressed = threading.Event()

    def make_prepped_xfer(self, op, local, local_ids, remote, remote_ids, notification):
        self.made.append((op, local, list(local_ids), remote, list(remote_ids), notification))
        return FakeXfer(self.refuse_release)

    def transfer(self, xfer):
        if self.transfer_raises:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return self.states.pop(0)

    def check_xfer_state(self, xfer):
        self.num_checks += 1
        return self.states.pop(0)

    def get_new_notifs(self):
        self.num_notif_calls += 1
        self.progressed.set()
        return {"peer": [b"note-%d" % self.num_notif_calls]}


def prepped_server(nixl: FakeNixl) -> tuple[AgentServer, int, int]:
    server = AgentServer(agent=nixl, receive_fd=lambda: -1)
    return server, server._keep("local-dlist"), server._keep("remote-dlist")


def spec(local: int, remote: int, notification: bytes = b"pulled"):
    from pdserve.transfer.read_steps import ReadSpec

    return ReadSpec(local, remote, "peer", notification, local_ids=[1, 4], remote_ids=[2, 3])


def test_a_read_done_when_started_is_made_from_the_prepared_lists_and_released_here():
    nixl = FakeNixl(["DONE"])
    server, local, remote = prepped_server(nixl)
    assert server.op_read(spec(local, remote), 0.0) == (0, "DONE", True, "")
    assert nixl.made == [("READ", "local-dlist", [1, 4], "remote-dlist", [2, 3], b"pulled")]
    assert set(server._objects) == {local, remote}  # the transfer is gone


def test_a_pending_read_is_released_here_by_the_check_that_sees_it_finish():
    nixl = FakeNixl(["PROC", "PROC", "ERR"])
    server, local, remote = prepped_server(nixl)
    object_id, status, released, _ = server.op_read(spec(local, remote), 0.0)
    xfer = server._objects[object_id]
    assert (status, released) == ("PROC", False)
    assert server.op_check_read(object_id) == ("PROC", False)
    assert server.op_check_read(object_id) == ("ERR", True)
    assert object_id not in server._objects and xfer.num_releases == 1


def test_a_release_nixl_refuses_leaves_the_read_to_the_engine_and_a_raising_transfer_is_err():
    refused = FakeNixl(["DONE"], refuse_release=True)
    server, local, remote = prepped_server(refused)
    object_id, status, released, _ = server.op_read(spec(local, remote), 0.0)
    assert (status, released) == ("DONE", False) and object_id in server._objects
    server._objects[object_id].refuse_release = False  # NIXL can cancel it now
    server.op_release(object_id)  # the engine's Read.release asks again
    assert object_id not in server._objects
    broken = FakeNixl([], transfer_raises=True)
    server, local, remote = prepped_server(broken)
    object_id, status, released, error = server.op_read(spec(local, remote), 0.0)
    assert (object_id, status, released) == (0, "ERR", True) and "REMOTE_DISCONNECT" in error


def test_settling_checks_a_new_read_until_it_finishes_or_the_bound_passes():
    from pdserve.transfer.read_steps import MAX_SETTLE_S, start_read_steps

    now = [0.0]

    def clock():  # every look at the clock is 1 ms later
        now[0] += 0.001
        return now[0]

    finishing = FakeNixl(["PROC", "PROC", "DONE"])
    _, status, released, _ = start_read_steps(finishing, spec("l", "r"), 0.005, clock)
    assert (status, released, finishing.num_checks) == ("DONE", True, 2)
    stuck = FakeNixl(["PROC"] * 100)
    _, status, released, _ = start_read_steps(stuck, spec("l", "r"), 0.002, clock)
    assert (status, released) == ("PROC", False) and stuck.num_checks <= 2  # bounded by the clock, not the read
    server, local, remote = prepped_server(FakeNixl(["DONE"]))
    with pytest.raises(ValueError, match="settle_s"):
        server.op_read(spec(local, remote), MAX_SETTLE_S * 2)


def test_the_process_progresses_its_agent_between_requests_and_keeps_the_notifications():
    from multiprocessing import Pipe

    from pdserve.transfer.agent_process import serve

    nixl = FakeNixl([])
    server = AgentServer(agent=nixl, receive_fd=lambda: -1)
    engine, agent_end = Pipe()
    # A frozen clock: the engine always "just called", so the process stays active however late this
    # thread runs on a loaded machine (its 0.25 s window is not what the test is about).
    thread = threading.Thread(target=serve, args=(agent_end, server, lambda: 0.0), daemon=True)
    thread.start()
    try:
        engine.send(("notifs", ()))
        assert engine.recv() == ("ok", {"peer": [b"note-1"]})
        nixl.progressed.clear()
        assert nixl.progressed.wait(10), "no progress between requests"  # nobody asked: the process did
        engine.send(("notifs", ()))
        kind, gathered = engine.recv()
        assert kind == "ok" and gathered["peer"][0] == b"note-2" and len(gathered["peer"]) >= 2
        assert [int(m.split(b"-")[1]) for m in gathered["peer"]] == list(range(2, 2 + len(gathered["peer"])))
        engine.send(("self_progress", (0.0,)))
        assert engine.recv() == ("ok", None)
        engine.send(("notifs", ()))  # what it gathered before it stopped
        assert engine.recv()[0] == "ok"
        calls = nixl.num_notif_calls
        engine.send(("notifs", ()))
        assert engine.recv() == ("ok", {"peer": [b"note-%d" % (calls + 1)]})  # nothing gathered meanwhile
    finally:
        engine.send(("close", ()))
        thread.join(10)
