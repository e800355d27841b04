"""A tensor-parallel worker's offload tier: rank 0's tier copies its own slice and queues the same
copies for the other ranks, which apply them to their slices in order. Only copies that started on
rank 0 are sent. Host memory: a follower that cannot copy stops the worker rather than drift out of
step. Files: each rank reads on its own I/O thread, a load lands only once every rank's read ended,
and a read that fails on one rank alone fails the load (the request recomputes).

Rank 0's real `LeaderChannel` talks to a follower in the same process: a broadcast applies the
message's commands there, a gather collects its real `RankReport`."""

from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch

from pdserve.api.config import CacheConfig, ParallelConfig, WorkerConfig
from pdserve.app.kv_cache_side import num_offload_slots
from pdserve.runner.offload_ranks import FileTierFollower, HostTierFollower, RankMirror, TierRead, TierWrite
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.offload import OffloadTier, PageLoad
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_host import HostPageStore
from pdserve.kv.offload_writes import SerialExecutor
from pdserve.parallel.channel import LeaderChannel, RankMessage, RankReport
from pdserve.parallel.ranks import RanksLost

PAGE = 64
FULL = 0  # the one (full-attention) group


def slice_pool(rank: int) -> torch.Tensor:
    """Rank `rank`'s slice: 6 blocks whose pages differ between ranks (each holds its own heads)."""
    return torch.arange(6 * PAGE, dtype=torch.int64).remainder(100).add(rank * 7).to(torch.int8).view(6, PAGE)


class OneFollowerGroup:
    """Rank 0's view of a 2-rank group whose rank 1 runs in this process."""

    size = 2
    timeout_s = 30.0

    def __init__(self, follower):  # type: ignore[no-untyped-def]
        self.follower = follower
        self.sent: list[RankMessage] = []

    def broadcast(self, message: RankMessage) -> RankMessage:
        self.sent.append(message)
        self.follower.apply(message.commands)
        return message

    def gather(self, record: object) -> list:
        return [record, RankReport(None, self.follower.report())]


def key(n: int) -> tuple[bytes, int]:
    return (bytes([n]) * 8, FULL)


def load_of(block_id: int, n: int) -> PageLoad:
    return PageLoad(block_id, key(n)[0], FULL, None)


def poll_until_ended(ranks: "FileRanks", load_id: str):  # type: ignore[no-untyped-def]
    """Poll once the follower got every queued command and each I/O thread ran what it was given
    (no wall clock: the mirror's clock advances a second per reading, so it always asks again)."""
    ranks.channel.send()
    for executor in ranks.io:
        executor.submit(lambda: None).result(timeout=30)
    results = ranks.tier.poll()
    assert load_id in results.landed + results.failed
    return results


def test_every_rank_ends_with_its_own_slice_of_the_same_pages():
    pools = [slice_pool(0), slice_pool(1)]
    expected = [pool.clone() for pool in pools]
    follower = HostTierFollower(HostPageStore(pools[1], 4 * PAGE), rank=1)
    group = OneFollowerGroup(follower)
    channel = LeaderChannel(group)  # type: ignore[arg-type]
    tier = OffloadTier(HostPageStore(pools[0], 4 * PAGE), [FULL], mirror=RankMirror(channel, 1, others_answer=False))
    tier.offer(2, key(2), None)  # block 2 evicted into the tier ...
    tier.offer(3, key(3), None)
    channel.send(step="a step")  # ... its copies ride ahead of the step
    for pool in pools:
        pool[2] = 0  # ... which overwrites block 2 on every rank
    tier.pin([key(3), key(2)])
    tier.start_tier_read("r1", [load_of(5, 3), load_of(4, 2)])  # a hit loads both pages into fresh blocks
    assert tier.poll().landed == ["r1"]  # host copies: nothing to wait for
    channel.send(step="the next step")
    assert [m.commands for m in group.sent] == [(TierWrite(0, 2), TierWrite(1, 3)), (TierRead((1, 0), (5, 4), "r1"),)]
    for rank, pool in enumerate(pools):
        assert torch.equal(pool[4], expected[rank][2]) and torch.equal(pool[5], expected[rank][3])
    assert not torch.equal(pools[0][4], pools[1][4])  # each rank copied its own slice


def test_a_copy_that_fails_on_rank_0_is_not_sent():
    queued: list = []

    class Link:
        tier_reads: list = []
        queue = queued.append

    tier = OffloadTier(HostPageStore(slice_pool(0), 2 * PAGE), [FULL], mirror=RankMirror(Link(), 1, others_answer=False))
    tier.offer(1, key(1), None)
    tier.pin([key(1)])
    tier.start_tier_read("r1", [load_of(99, 1)])  # no such block
    assert tier.poll().failed == ["r1"]
    assert queued == [TierWrite(0, 1)]


def test_a_host_follower_that_cannot_copy_stops_the_worker():
    follower = HostTierFollower(HostPageStore(slice_pool(1), 2 * PAGE), rank=1)
    with pytest.raises(RanksLost, match="rank 1: an offload tier copy failed"):
        follower.apply([TierRead((0,), (99,))])


class FileRanks:
    """Rank 0's file tier and rank 1's file follower, each with its own file and I/O thread."""

    def __init__(self, directory: str, num_staging_rows: int = 4):
        self.pools = [slice_pool(0), slice_pool(1)]
        self.expected = [pool.clone() for pool in self.pools]
        self.io = [SerialExecutor(), SerialExecutor()]
        self.follower = FileTierFollower(FilePageStore(self.pools[1], 4 * PAGE, os.path.join(directory, "rank-1"),
                                                       num_staging_rows), 1, self.io[1])
        self.channel = LeaderChannel(OneFollowerGroup(self.follower))  # type: ignore[arg-type]
        self.store = FilePageStore(self.pools[0], 4 * PAGE, directory, num_staging_rows)
        self.tier = OffloadTier(self.store, [FULL], executor=self.io[0],
                                mirror=RankMirror(self.channel, 1, others_answer=True,
                                                  clock=itertools.count().__next__))

    def store_and_overwrite(self, *block_ids: int) -> None:
        for block_id in block_ids:
            self.tier.offer(block_id, key(block_id), None)
        self.channel.send(step="a step")
        for pool in self.pools:
            pool[list(block_ids)] = 0

    def load(self, load_id: str, pairs: list[tuple[int, int]]) -> None:
        """(destination block, page of block n) pairs."""
        self.tier.pin([key(n) for _, n in pairs])
        self.tier.start_tier_read(load_id, [load_of(block_id, n) for block_id, n in pairs])

    def close(self) -> None:
        self.follower.close()
        self.io[0].shutdown(wait=True)
        self.store.close()


@pytest.fixture
def file_ranks(tmp_path):
    ranks = FileRanks(str(tmp_path))
    yield ranks
    ranks.close()


def test_a_file_tier_load_lands_once_every_rank_read_its_slice(file_ranks):
    file_ranks.store_and_overwrite(2, 3)
    file_ranks.load("r1", [(4, 2), (5, 3)])
    results = poll_until_ended(file_ranks, "r1")
    assert results.landed == ["r1"]
    for rank, pool in enumerate(file_ranks.pools):
        assert torch.equal(pool[4], file_ranks.expected[rank][2]) and torch.equal(pool[5], file_ranks.expected[rank][3])
    assert not torch.equal(file_ranks.pools[0][4], file_ranks.pools[1][4])
    assert os.path.getsize(os.path.join(file_ranks.follower.store.path)) == 2 * PAGE  # its own file, its own pages


def test_a_file_tier_load_waits_for_the_other_ranks_read(file_ranks):
    file_ranks.store_and_overwrite(2)
    gate = threading.Event()
    file_ranks.io[1].submit(gate.wait, 30)  # rank 1's I/O thread is busy until the gate opens
    file_ranks.load("r1", [(4, 2)])
    file_ranks.io[0].submit(lambda: None).result(timeout=30)  # rank 0's own read has ended
    assert file_ranks.tier.poll().landed == []
    assert file_ranks.tier.is_loading("r1")  # its blocks stay allocated: rank 1 may still write them
    gate.set()
    assert poll_until_ended(file_ranks, "r1").landed == ["r1"]
    assert torch.equal(file_ranks.pools[1][4], file_ranks.expected[1][2])


def test_a_read_that_fails_on_one_rank_alone_fails_the_load(file_ranks):
    file_ranks.store_and_overwrite(2, 3)
    file_ranks.io[1].submit(lambda: None).result(timeout=30)  # rank 1's writes ended
    with open(file_ranks.follower.store.path, "r+b") as pages:  # rank 1's copy of slot 0 is corrupt
        pages.write(b"\xff" * 8)
    file_ranks.load("r1", [(4, 2), (5, 3)])
    results = poll_until_ended(file_ranks, "r1")
    assert results.failed == ["r1"] and results.landed == []
    assert file_ranks.tier.stats.num_failed_loads == 1
    assert file_ranks.tier.lookup(*key(2)) is None  # a page one rank cannot serve is a miss from now on
    file_ranks.tier.check_invariants()


def test_a_follower_that_cannot_stage_a_page_forgets_its_slot(tmp_path):
    ranks = FileRanks(str(tmp_path), num_staging_rows=1)
    try:
        gate = threading.Event()
        ranks.io[1].submit(gate.wait, 30)  # rank 1's disk lags: its one staging row stays taken
        ranks.tier.offer(2, key(2), None)
        ranks.io[0].submit(lambda: None).result(timeout=30)  # rank 0's row is free again
        ranks.tier.offer(3, key(3), None)
        ranks.channel.send(step="a step")  # rank 1 stages block 2 and has no row for block 3
        gate.set()
        ranks.load("r1", [(4, 3)])
        assert poll_until_ended(ranks, "r1").failed == ["r1"]
        ranks.load("r2", [(5, 2)])  # the page it did stage is still served
        assert poll_until_ended(ranks, "r2").landed == ["r2"]
        assert torch.equal(ranks.pools[1][5], ranks.expected[1][2])
    finally:
        ranks.close()


def test_tensor_parallel_takes_both_tiers(tmp_path):
    layout = KVPoolLayout(8, 2, 4, 2, 16, torch.float32)
    host = WorkerConfig(cache=CacheConfig(kv_offload_bytes=10 * layout.page_bytes),
                        parallel=ParallelConfig(tensor_parallel_size=2))
    assert num_offload_slots(host, layout) == 10
    files = host.model_copy(update={"cache": CacheConfig(kv_offload_bytes=10 * layout.page_bytes,
                                                         kv_offload_dir=str(tmp_path))})
    assert num_offload_slots(files, layout) == 10
