"""The shared-memory all-reduce and all-gather between ranks on one host (issue 40, part 2): two real
processes over one segment give exact sums and the same bits on both sides, in pieces when a tensor
outgrows a slot; a peer that never arrives or dies raises RanksLost within the timeout, as gloo's
path does; a segment that is not rank 0's is refused; and two RankGroups agree on the path and carry
tensors and sealed control records over it as over gloo. Each rank runs the Python path or the
native all-reduce (`use_native`), mixed: the two keep one protocol and give the same bits."""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
import time

import pytest
import torch

from pdserve.parallel.control import ControlRecordRejected
from pdserve.parallel.errors import RanksLost
from pdserve.parallel.host_collectives import HostCollectives, shared_memory_check
from pdserve.parallel.host_segment import (SegmentInvite, SegmentUnavailable, create_segment, open_segment,
                                           unlink_segment)

SMALL_SLOT_BYTES = 256  # 64 float32: the tensors below need several pieces
TIMEOUT_S = 20.0
CONTEXT = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch thread pools

pytestmark = pytest.mark.skipif(shared_memory_check(torch.device("cpu")) is not None,
                                reason="the shared-memory path is x86-64 only")


def rank_inputs(rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` contributes: integer-valued floats (exact sums), random floats (bitwise
    agreement), bfloat16, a non-contiguous view, and a tensor of 5 pieces."""
    generator = torch.Generator().manual_seed(rank)
    return {"integers": torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1),
            "random": torch.randn(7, 33, generator=generator),
            "bf16": torch.full((5, 3), 1.5 * (rank + 1), dtype=torch.bfloat16),
            "strided": torch.arange(40, dtype=torch.float32).view(5, 8)[:, ::2] + rank,
            "long": torch.randn(300, generator=generator),
            "gather": torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank}


def as_bytes(value) -> bytes:  # noqa: ANN001
    """Tensors by value: a queue would share their storage by descriptor, gone once the child exits."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):  # noqa: ANN201
    return torch.load(io.BytesIO(data))


def run_rank(collectives: HostCollectives) -> dict[str, torch.Tensor]:
    results = {}
    for name, tensor in rank_inputs(collectives.rank).items():
        if name == "gather":
            results[name] = collectives.all_gather(tensor)
        else:
            results[name] = collectives.all_reduce(tensor).clone()
    return results


def native_or_skip(collectives: HostCollectives, native: bool) -> HostCollectives:
    if native and not collectives.use_native():
        pytest.skip("no native kernels here")
    return collectives


def follower(invite: SegmentInvite, rank: int, answers, exit_after: int = -1,  # noqa: ANN001
             native: bool = False) -> None:
    collectives = HostCollectives(open_segment(invite, rank), TIMEOUT_S)
    if native:
        assert collectives.use_native()
    if exit_after >= 0:
        for _ in range(exit_after):
            collectives.all_reduce(torch.ones(4))
        os._exit(0)  # dies without a word, mid-run
    answers.put(as_bytes(run_rank(collectives)))


@pytest.fixture
def leader_segment():
    segment, invite = create_segment(2, SMALL_SLOT_BYTES)
    yield segment, invite
    unlink_segment(invite.path)
    segment.close()


@pytest.mark.parametrize("leader_native,follower_native", [(False, False), (True, False), (False, True),
                                                           (True, True)])
def test_two_processes_sum_exactly_and_agree_bit_for_bit(leader_segment, leader_native, follower_native):
    segment, invite = leader_segment
    leader = native_or_skip(HostCollectives(segment, TIMEOUT_S), leader_native)
    answers = CONTEXT.Queue()
    child = CONTEXT.Process(target=follower, args=(invite, 1, answers, -1, follower_native))
    child.start()
    mine = run_rank(leader)
    theirs = from_bytes(answers.get(timeout=60))
    child.join(30)
    first, second = rank_inputs(0), rank_inputs(1)
    assert torch.equal(mine["integers"], torch.arange(12, dtype=torch.float32).view(3, 4) * 3)
    assert torch.equal(mine["bf16"], torch.full((5, 3), 4.5, dtype=torch.bfloat16))
    assert torch.equal(mine["strided"], first["strided"] + second["strided"])
    assert torch.allclose(mine["random"], first["random"] + second["random"])
    assert torch.allclose(mine["long"], first["long"] + second["long"])
    assert torch.equal(mine["gather"], torch.cat([first["gather"], second["gather"]], dim=-1))
    for name in mine:
        assert mine[name].dtype == first[name].dtype and torch.equal(mine[name], theirs[name]), name
    assert child.exitcode == 0


@pytest.mark.parametrize("native", [False, True])
def test_a_peer_that_never_arrives_raises_ranks_lost_within_the_timeout(leader_segment, native):
    segment, _ = leader_segment
    collectives = native_or_skip(HostCollectives(segment, timeout_s=0.2), native)
    started_s = time.monotonic()
    with pytest.raises(RanksLost, match=r"rank 0: an all-reduce failed: no word from rank\(s\) \[1\] within 0.2 s"):
        collectives.all_reduce(torch.ones(8))
    assert time.monotonic() - started_s < 5.0
    with pytest.raises(RanksLost, match="an all-gather failed"):
        collectives.all_gather(torch.ones(2, 2))


@pytest.mark.parametrize("native", [False, True])
def test_a_peer_that_dies_mid_run_makes_the_next_collective_raise_ranks_lost(leader_segment, native):
    segment, invite = leader_segment
    answers = CONTEXT.Queue()
    child = CONTEXT.Process(target=follower, args=(invite, 1, answers, 2))
    child.start()
    collectives = HostCollectives(segment, TIMEOUT_S)  # the child takes seconds to start
    assert torch.equal(collectives.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
    assert segment.watch_peers() == [1]  # the child wrote its pid when it mapped the segment
    native_or_skip(collectives, native)  # after watch_peers, as RankGroup does: it watches the child too
    assert torch.equal(collectives.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
    child.join(30)
    assert child.exitcode == 0
    started_s = time.monotonic()
    with pytest.raises(RanksLost, match=r"rank 0: an all-reduce failed: rank\(s\) \[1\] exited"):
        collectives.all_reduce(torch.ones(4))
    assert time.monotonic() - started_s < TIMEOUT_S / 2  # its exit, not the timeout, ended the wait


@pytest.mark.parametrize("native", [False, True])
def test_closing_the_ranks_while_a_collective_waits_in_another_thread_ends_it_without_a_crash(leader_segment, native):
    segment, _ = leader_segment
    collectives = native_or_skip(HostCollectives(segment, timeout_s=1.0), native)
    errors = []

    def wait() -> None:
        try:
            collectives.all_reduce(torch.ones(8))
        except RanksLost as error:
            errors.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while segment._flags[0] < 1:  # forced order: rank 0 published its part and waits for rank 1
        time.sleep(0.001)
    collectives.close()  # e.g. a shutdown; the mapping must stay under the waiting call
    waiter.join(30)
    assert not waiter.is_alive() and "no word from rank(s) [1]" in str(errors[0])
    with pytest.raises((RuntimeError, IndexError)):  # closed: nothing more goes through it
        collectives.all_reduce(torch.ones(8))


def test_a_segment_that_is_not_rank_zeros_is_refused(leader_segment):
    _, invite = leader_segment
    forged = SegmentInvite(invite.path, bytes(16), invite.num_ranks, invite.slot_bytes)
    with pytest.raises(SegmentUnavailable, match="another nonce"):
        open_segment(forged, 1)
    with pytest.raises(SegmentUnavailable, match="cannot open"):
        open_segment(SegmentInvite(invite.path + "-gone", invite.nonce, 2, invite.slot_bytes), 1)
    with pytest.raises(SegmentUnavailable, match="bytes long"):
        open_segment(SegmentInvite(invite.path, invite.nonce, 3, invite.slot_bytes), 1)


def test_a_control_record_longer_than_the_bound_is_refused_before_it_is_read(leader_segment):
    segment, invite = leader_segment
    leader = HostCollectives(segment, TIMEOUT_S)
    follower = HostCollectives(open_segment(invite, 1), timeout_s=0.5)
    errors = []

    def send() -> None:
        try:
            follower.exchange_bytes(b"x" * 600, 10_000, "a gather")  # three slots' worth
        except RanksLost as error:
            errors.append(error)

    sender = threading.Thread(target=send)
    sender.start()
    with pytest.raises(ControlRecordRejected, match="600 bytes"):
        leader.exchange_bytes(b"", 100, "a gather")
    sender.join(TIMEOUT_S)
    # rank 0 stopped after the first slot: the sender's next exchange finds nobody, as on a lost rank
    assert not sender.is_alive() and "no word from rank(s) [0]" in str(errors[0])


def test_a_directory_that_cannot_hold_the_segment_leaves_the_ranks_on_gloo(tmp_path):
    with pytest.raises(SegmentUnavailable, match="cannot create"):
        create_segment(2, SMALL_SLOT_BYTES, directory=str(tmp_path / "missing"))


def group_rank(rank: int, port: int, enabled: tuple[bool, bool], answers) -> None:  # noqa: ANN001
    from pdserve.parallel.ranks import RankGroup

    group = RankGroup(rank, 2, "127.0.0.1", port, TIMEOUT_S, torch.device("cpu"))
    try:
        shared = group.share_host_memory(enabled[rank], torch.device("cpu"), slot_bytes=SMALL_SLOT_BYTES)
        reduced = group.all_reduce(torch.arange(200, dtype=torch.float32) * (rank + 1))
        gathered = group.all_gather(torch.full((2, 2), float(rank)))
        # control records too, several slots long: rank 0's broadcast, every rank's report to rank 0
        record = group.broadcast({"step": list(range(500))} if rank == 0 else None)
        reports = group.gather(("report", rank, "x" * 300 * rank))
        answers.put(as_bytes((rank, shared, group.tensor_path, reduced, gathered, record, reports)))
    finally:
        group.close()


@pytest.mark.parametrize("enabled", [(True, True), (True, False)], ids=["shared-memory", "rank-1-refuses"])
def test_two_rank_groups_agree_on_the_path_and_compute_the_same(enabled):
    """Shared memory only where every rank takes it: one rank without it keeps both on gloo."""
    from pdserve.parallel.rendezvous import listen_on

    with listen_on("127.0.0.1", 0) as probe:  # a free port; rank 0's store binds it once released
        port = probe.getsockname()[1]
    answers = CONTEXT.Queue()
    ranks = [CONTEXT.Process(target=group_rank, args=(rank, port, enabled, answers)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    results = sorted(from_bytes(answers.get(timeout=120)) for _ in ranks)
    for process in ranks:
        process.join(30)
    expected = (True, "shared memory") if all(enabled) else (False, "gloo")
    for rank, shared, path, reduced, gathered, record, reports in results:
        assert (shared, path) == expected, rank
        assert torch.equal(reduced, torch.arange(200, dtype=torch.float32) * 3)
        assert torch.equal(gathered, torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2))
        assert record == {"step": list(range(500))}
        assert reports == ([("report", 0, ""), ("report", 1, "x" * 300)] if rank == 0 else None)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"pdserve-tp-{ranks[0].pid}-")]
