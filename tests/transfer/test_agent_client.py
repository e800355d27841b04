"""The hard bound on calls into an isolated NIXL agent (pdserve/transfer/agent_client.py), against a
fake agent process: the test holds the other end of the socket pair and writes what it likes, in
the order it likes. An answer cut off halfway, a malformed answer and a closed socket each mark the
agent dead; the wait for the killed process is bounded."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
from multiprocessing.connection import Connection

import pytest

from pdserve.transfer.agent_client import KILL_WAIT_S, AgentCallFailed, AgentProcessDied, IsolatedAgent

pytestmark = pytest.mark.timeout(30)  # before the fix, a reply cut off halfway blocked the call for ever


class FakeProcess:
    """A Popen stand-in; `wait` without a timeout fails the test (an unbounded wait)."""

    pid = 4242

    def __init__(self, exits_when_killed: bool = True):
        self.exits_when_killed = exits_when_killed
        self.killed = False
        self.waits: list = []

    def poll(self):
        return -9 if self.killed and self.exits_when_killed else None

    def kill(self):
        self.killed = True

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is None:
            pytest.fail("an unbounded wait for the agent process")
        if self.killed and self.exits_when_killed:
            return -9
        raise subprocess.TimeoutExpired("agent", timeout)


class FakeAgentEnd:
    def __init__(self, process: FakeProcess):
        self.process = process
        self.sock: socket.socket | None = None

    def __call__(self, fd: int, name: str, progress_thread: bool, nixl_api_module: str) -> FakeProcess:
        self.sock = socket.socket(fileno=os.dup(fd))  # the agent closes its copy after the start
        return self.process

    def send(self, message) -> None:
        Connection(os.dup(self.sock.fileno())).send(message)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)


def started_agent(exits_when_killed: bool = True) -> tuple[IsolatedAgent, FakeAgentEnd]:
    end = FakeAgentEnd(FakeProcess(exits_when_killed))
    agent = IsolatedAgent("fake", call_timeout_s=0.2, start_process=end)
    end.send(("ready", ["UCX"]))
    assert agent.ready() and agent.backends == ["UCX"]
    return agent, end


def test_a_whole_answer_is_returned_and_an_error_answer_raises_without_killing():
    agent, end = started_agent()
    end.send(("ok", b"metadata"))
    assert agent.get_agent_metadata() == b"metadata"
    end.send(("err", "NIXL_ERR_NOT_FOUND"))
    with pytest.raises(AgentCallFailed, match="NOT_FOUND"):
        agent.call("check", 7)
    assert agent.dead is None and not end.process.killed


def test_an_answer_cut_off_halfway_is_a_dead_agent_within_the_call_bound():
    agent, end = started_agent()
    payload = pickle.dumps(("ok", b"x" * 100))
    end.send_raw(struct.pack("!i", len(payload)) + payload[:20])  # and nothing more
    with pytest.raises(AgentProcessDied, match="cut off"):
        agent.get_agent_metadata()
    assert end.process.killed and agent.dead is not None
    with pytest.raises(AgentProcessDied):
        agent.call("notifs")  # every later call too


@pytest.mark.parametrize("frame", [
    struct.pack("!i", 5) + b"\x80\x05junk",  # bytes that do not unpickle
    struct.pack("!i", -7),  # an impossible length
], ids=["not-a-pickle", "bad-length"])
def test_undecodable_answers_are_a_dead_agent(frame):
    agent, end = started_agent()
    end.send_raw(frame)
    with pytest.raises(AgentProcessDied):
        agent.call("notifs")
    assert end.process.killed


@pytest.mark.parametrize("reply", [42, ("ok",), ("maybe", 1), ("err", 3)], ids=str)
def test_answers_of_the_wrong_shape_are_a_dead_agent(reply):
    agent, end = started_agent()
    end.send(reply)
    with pytest.raises(AgentProcessDied, match="malformed"):
        agent.call("notifs")
    assert end.process.killed


def test_a_closed_socket_is_a_dead_agent():
    agent, end = started_agent()
    end.sock.close()
    with pytest.raises(AgentProcessDied):
        agent.call("notifs")


def test_the_wait_for_a_killed_agent_that_does_not_exit_is_bounded():
    agent, end = started_agent(exits_when_killed=False)  # e.g. stuck in uninterruptible sleep
    end.sock.close()
    with pytest.raises(AgentProcessDied, match="after SIGKILL"):
        agent.call("notifs")
    assert end.process.killed and end.process.waits == [KILL_WAIT_S]


def test_closing_an_agent_that_ignores_close_kills_it_with_a_bounded_wait():
    agent, end = started_agent(exits_when_killed=False)
    end.send(("ok", None))  # answers "close" but never exits
    agent.close()
    assert end.process.killed and None not in end.process.waits and agent.dead is not None


# ---- issue 36 item 4: a memfd is unmapped in the agent with its last registration ------------------


def requests_seen(end: FakeAgentEnd, count: int) -> list[str]:
    """The ops the agent was sent (a "map" is followed by its file descriptor, taken here)."""
    from multiprocessing.reduction import recv_handle

    connection, ops = Connection(os.dup(end.sock.fileno())), []
    for _ in range(count):
        op, _args = connection.recv()
        ops.append(op)
        if op == "map":
            os.close(recv_handle(connection))
    return ops


def test_the_last_deregistration_of_a_memfd_unmaps_it_in_the_agent():
    import torch

    from pdserve.kv.shared_memory import shared_zeros

    agent, end = started_agent()
    memory = torch.frombuffer(shared_zeros(1 << 16), dtype=torch.int8)
    for reply in (None, 1, 2, None, None, None):  # map, register x2, deregister x2, unmap
        end.send(("ok", reply))
    first, second = agent.register_memory(memory), agent.register_memory(memory[:4096])
    agent.deregister_memory(first)
    assert requests_seen(end, 4) == ["map", "register", "register", "deregister"]  # one left: still mapped
    agent.deregister_memory(second)
    assert requests_seen(end, 2) == ["deregister", "unmap"]
    end.send(("ok", None))
    end.send(("ok", 3))
    agent.register_memory(memory)  # mapped afresh: the agent holds nothing there any more
    assert requests_seen(end, 2) == ["map", "register"]


def test_an_address_the_agent_process_already_uses_is_told_apart_from_other_failures():
    """The map fails with the agent's FileExistsError when its own random layout took the range: that
    one failure is `AddressTaken` (a fresh agent process can map it; nixl_transport starts one)."""
    import torch

    from pdserve.kv.shared_memory import shared_zeros
    from pdserve.transfer.agent_client import AddressTaken

    agent, end = started_agent()
    memory = torch.frombuffer(shared_zeros(1 << 16), dtype=torch.int8)
    end.send(("err", "FileExistsError(17, 'cannot map shared memory at 0x7fa64d6af000: File exists')"))
    with pytest.raises(AddressTaken, match="cannot map shared memory"):
        agent.register_memory(memory)
    end.send(("err", "OSError(12, 'Cannot allocate memory')"))
    with pytest.raises(AgentCallFailed) as failed:
        agent.register_memory(memory)
    assert not isinstance(failed.value, AddressTaken)
    assert requests_seen(end, 2) == ["map", "map"]  # nothing was mapped: each try maps again


# ---- issue 38: a read in one request; the agent releases it when finished ------------------------


def test_a_read_starts_in_one_request_and_a_finished_one_is_never_released_again():
    import numpy as np

    from pdserve.transfer.read_steps import ReadSpec

    agent, end = started_agent()
    end.send(("ok", (0, "DONE", True, "")))
    read = agent.start_read(ReadSpec(np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64), "peer", b"n"), 0.0)
    assert (read.status, read.released) == ("DONE", True)
    read.release()  # sends nothing: the agent released it
    assert requests_seen(end, 1) == ["read"]
    end.send(("ok", (7, "PROC", False, "")))
    pending = agent.start_read(ReadSpec(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), "peer", b""), 0.0)
    end.send(("ok", ("DONE", True)))
    assert agent.check_read(pending) == "DONE" and pending.released
    pending.release()
    assert requests_seen(end, 2) == ["read", "check_read"]


@pytest.mark.parametrize("op, reply", [
    ("read", (1, "MAYBE", False, "")), ("read", (1, "DONE", 1, "")), ("read", "DONE"),
    ("check_read", ("DONE",)), ("check_read", ("WAT", True)),
], ids=str)
def test_a_read_answered_with_the_wrong_shape_is_a_dead_agent(op, reply):
    import numpy as np

    from pdserve.transfer.read_steps import Read, ReadSpec

    agent, end = started_agent()
    spec = ReadSpec(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), "peer", b"")
    end.send(("ok", reply))
    with pytest.raises(AgentProcessDied, match=f"answered '{op}' with a malformed reply"):
        if op == "read":
            agent.start_read(spec, 0.0)
        else:
            from pdserve.transfer.agent_client import _AgentObject

            agent.check_read(Read(_AgentObject(agent, 3), "PROC"))
    assert end.process.killed and agent.dead is not None


def test_an_agent_that_dies_mid_read_fails_every_later_call_and_its_read_releases_as_a_no_op():
    import numpy as np

    from pdserve.transfer.read_steps import ReadSpec

    agent, end = started_agent()
    end.send(("ok", (5, "PROC", False, "")))
    read = agent.start_read(ReadSpec(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), "peer", b""), 0.0)
    payload = pickle.dumps(("ok", ("DONE", True)))
    end.send_raw(struct.pack("!i", len(payload)) + payload[:5])  # the process dies mid-answer
    with pytest.raises(AgentProcessDied, match="cut off"):
        agent.check_read(read)
    assert end.process.killed
    read.release()  # a dead process writes no memory: nothing to send
    with pytest.raises(AgentProcessDied):
        agent.start_read(ReadSpec([], [], "peer", b""), 0.0)
