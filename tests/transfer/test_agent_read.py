"""A KV READ in one request to the agent process (pdserve/transfer/read_steps.py, issue 38: D's pull
made one round trip per start and per check, no engine-side release): real NIXL agents, each in
its own process, pulling host memory from one another over UCX TCP in this test's process.

Order is forced, never timed: a read is held in flight by stopping the serving agent's process
(SIGSTOP: over TCP the READ needs it), and an agent dies mid-call by being stopped before the call
(its bound then kills it).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.agent_client import AgentProcessDied, IsolatedAgent
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.read_steps import ReadSpec
from pdserve.transfer.transport import TransferState

pytestmark = pytest.mark.timeout(120)

# 2 layer slots x K/V x 16 tokens x 2 heads x 8 dims x fp32 = 4096-byte pages
LAYOUT = dict(group_size=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
NUM_BLOCKS = 16
MAX_WAIT_S = 30.0


def pattern(num_blocks: int, page_bytes: int) -> torch.Tensor:
    values = torch.arange(num_blocks * page_bytes, dtype=torch.int64) * 7
    values += torch.arange(num_blocks, dtype=torch.int64).repeat_interleave(page_bytes) * 1009
    return values.remainder(251).to(torch.int8).view(num_blocks, page_bytes)


def pool(shared: bool) -> torch.Tensor:
    layout = KVPoolLayout(num_blocks=NUM_BLOCKS, **LAYOUT)
    return layout.canonical_view(layout.allocate("cpu", shared=shared))


@pytest.fixture(scope="module")
def prefill():
    """The serving side: a patterned pool behind its own agent process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", "tcp")  # a READ then needs the serving agent's process
        view = pool(shared=True)
        view.copy_(pattern(NUM_BLOCKS, view.shape[1]))
        transport = NixlTransport(view, "read-prefill", isolated=True)
        yield transport
        transport.close()


def decode_transport(name: str, **options) -> tuple[NixlTransport, torch.Tensor]:
    options.setdefault("isolated", True)
    view = pool(shared=options["isolated"])
    view.zero_()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", "tcp")
        return NixlTransport(view, name, **options), view


class Ops:
    """Records the requests an IsolatedAgent sends its process."""

    def __init__(self, agent: IsolatedAgent):
        self.seen: list[str] = []
        call = agent.call

        def recording(op, *args, **kwargs):
            self.seen.append(op)
            return call(op, *args, **kwargs)

        agent.call = recording


def wait(transport: NixlTransport, prefill: NixlTransport, handle, received: list | None = None) -> TransferState:
    """Poll the read to its end; the serving side's notifications meanwhile go to `received`."""
    received = [] if received is None else received
    deadline = time.monotonic() + MAX_WAIT_S
    while time.monotonic() < deadline:
        state = transport.poll(handle)
        if state is not TransferState.PENDING:
            return state
        received += prefill.poll_notifications()  # progresses the serving agent (no progress thread)
        time.sleep(0.002)
    raise AssertionError("the read neither finished nor failed")


def connect(transport: NixlTransport, prefill: NixlTransport) -> str:
    """The connect handshake, progressing the serving agent meanwhile (this process runs both sides)."""
    key = transport.begin_connect(prefill.local_peer_info("prefill", "e0"))
    deadline = time.monotonic() + MAX_WAIT_S
    while (state := transport.poll_connect(key)) is TransferState.PENDING:
        assert time.monotonic() < deadline, "not connected"
        prefill.poll_notifications()
        time.sleep(0.002)
    assert state is TransferState.DONE, transport.connect_failure(key)
    return key


def pull(transport, view, prefill, local: list[int], remote: list[int]) -> None:
    """Pull, then check the pages and that the notification reached the serving side."""
    key = connect(transport, prefill)
    notification = f"pulled {local}".encode()
    handle = transport.start_read(key, local, remote, notification)
    received: list[bytes] = []
    assert wait(transport, prefill, handle, received) is TransferState.DONE, handle.error
    assert transport.release(handle)
    deadline = time.monotonic() + MAX_WAIT_S
    while notification not in received:
        assert time.monotonic() < deadline, f"no notification {notification!r}: {received}"
        received += prefill.poll_notifications()
    expected = pattern(NUM_BLOCKS, view.shape[1])
    for local_id, remote_id in zip(local, remote):
        assert torch.equal(view[local_id], expected[remote_id]), (local_id, remote_id)


# Scattered ids use the prepared lists; consecutive ones merge into a run, described per read.
@pytest.mark.parametrize("local, remote", [([3, 9, 5], [7, 1, 12]), ([2, 3, 4], [10, 11, 12])],
                         ids=["prepped", "described"])
def test_a_single_request_read_lands_exactly_and_the_agent_releases_it(prefill, local, remote):
    transport, view = decode_transport("read-single")
    try:
        ops = Ops(transport._agent)
        pull(transport, view, prefill, local, remote)
        # connecting warms up step by step; the read itself is one "read" and its checks, never a release
        started = ops.seen.index("read")
        assert set(ops.seen[started + 1:]) <= {"check_read", "notifs"}, ops.seen
    finally:
        transport.close()


def test_the_stepwise_path_still_lands_exactly_and_releases_from_the_engine(prefill):
    transport, view = decode_transport("read-stepwise", read_op="stepwise")
    try:
        ops = Ops(transport._agent)
        pull(transport, view, prefill, [1, 6], [14, 2])
        started = ops.seen.index("prepped_xfer")
        assert "read" not in ops.seen and ops.seen[started + 1] == "transfer" and ops.seen[-1] == "release", ops.seen
    finally:
        transport.close()


def test_an_inline_agent_reads_through_the_same_code(prefill):
    transport, view = decode_transport("read-inline", isolated=False, read_settle_s=0.002)
    try:
        pull(transport, view, prefill, [0, 8, 4], [13, 5, 9])
        pull(transport, view, prefill, [10, 11], [3, 4])  # described
    finally:
        transport.close()


def test_a_pending_read_is_checked_until_done_then_released_by_the_agent(prefill):
    transport, view = decode_transport("read-pending", read_settle_s=0.002)
    try:
        key = connect(transport, prefill)
        os.kill(prefill._agent.pid, signal.SIGSTOP)  # nothing serves the READ: it stays PROC
        try:
            handle = transport.start_read(key, [7], [15], b"")
            read = transport._in_flight[handle.handle_id].xfer
            assert transport.poll(handle) is TransferState.PENDING and not read.released
        finally:
            os.kill(prefill._agent.pid, signal.SIGCONT)
        assert wait(transport, prefill, handle) is TransferState.DONE, handle.error
        assert read.released and read.status == "DONE"
        ops = Ops(transport._agent)
        assert transport.release(handle) and ops.seen == []  # nothing left to release in the agent
        assert torch.equal(view[7], pattern(NUM_BLOCKS, view.shape[1])[15])
    finally:
        transport.close()


def test_a_decode_agent_killed_while_its_read_is_pending_fails_the_read(prefill):
    transport, _ = decode_transport("read-killed")
    try:
        key = connect(transport, prefill)
        os.kill(prefill._agent.pid, signal.SIGSTOP)
        try:
            handle = transport.start_read(key, [2], [3], b"")
            assert transport.poll(handle) is TransferState.PENDING
            agent = transport._agent
            os.kill(agent.pid, signal.SIGKILL)
            assert wait(transport, prefill, handle) is TransferState.FAILED
        finally:
            os.kill(prefill._agent.pid, signal.SIGCONT)
        assert "NIXL agent process" in handle.error and agent.dead is not None
        assert transport.release(handle)
    finally:
        transport.close()


def test_an_agent_that_never_answers_the_read_dies_within_its_bound(prefill):
    transport, _ = decode_transport("read-stopped", agent_call_timeout_s=0.5)
    try:
        key = connect(transport, prefill)
        agent = transport._agent
        os.kill(agent.pid, signal.SIGSTOP)  # takes the request, never answers
        handle = transport.start_read(key, [2], [3], b"")
        assert handle.state is TransferState.FAILED and "cannot create the read" in handle.error
        assert agent.dead is not None and "'read'" in agent.dead
        with pytest.raises(AgentProcessDied):
            agent.start_read(ReadSpec([], [], "x", b""), 0.0)
    finally:
        transport.close()
