"""A tensor-parallel worker's host tier: rank 0's page store copies its own slice and queues the same
copies for the other ranks, which apply them to their slices in order; only successful copies are
sent, and a follower that cannot copy stops the worker rather than drift out of step."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.config import CacheConfig, ParallelConfig, WorkerConfig
from pdserve.engine.factory import _num_offload_slots
from pdserve.engine.offload_ranks import RankedPageStore, TierFollower, TierRead, TierWrite
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.offload import OffloadIOError
from pdserve.kv.offload_host import HostPageStore
from pdserve.parallel.ranks import RanksLost

PAGE = 64


def slice_pool(rank: int) -> torch.Tensor:
    """Rank `rank`'s slice: 6 blocks whose pages differ between ranks (each holds its own heads)."""
    return torch.arange(6 * PAGE, dtype=torch.int64).remainder(100).add(rank * 7).to(torch.int8).view(6, PAGE)


def test_every_rank_ends_with_its_own_slice_of_the_same_pages():
    pools = [slice_pool(0), slice_pool(1)]
    expected = [pool.clone() for pool in pools]
    queued: list = []
    leader = RankedPageStore(HostPageStore(pools[0], 4 * PAGE), queued.append)
    follower = TierFollower(HostPageStore(pools[1], 4 * PAGE), rank=1)
    leader.write(0, 2)  # block 2 evicted into slot 0
    leader.write(1, 3)
    follower.apply(queued[:2])  # the message's copies, before its step ...
    for pool in pools:
        pool[2] = 0  # ... which overwrites block 2 on every rank
    leader.read([1, 0], [5, 4])  # a hit loads both pages into fresh blocks
    assert queued == [TierWrite(0, 2), TierWrite(1, 3), TierRead((1, 0), (5, 4))]
    follower.apply([object(), queued[2]])  # a transport command is not the tier's
    for rank, pool in enumerate(pools):
        assert torch.equal(pool[4], expected[rank][2]) and torch.equal(pool[5], expected[rank][3])
    assert not torch.equal(pools[0][4], pools[1][4])  # each rank copied its own slice


def test_a_copy_that_fails_on_rank_0_is_not_sent():
    queued: list = []
    leader = RankedPageStore(HostPageStore(slice_pool(0), 2 * PAGE), queued.append)
    with pytest.raises(OffloadIOError):
        leader.read([0], [99])  # no such block
    assert queued == []


def test_a_follower_that_cannot_copy_stops_the_worker():
    follower = TierFollower(HostPageStore(slice_pool(1), 2 * PAGE), rank=1)
    with pytest.raises(RanksLost, match="rank 1: an offload tier copy failed"):
        follower.apply([TierRead((0,), (99,))])


def test_tensor_parallel_takes_the_host_tier_and_refuses_the_file_tier(tmp_path):
    layout = KVPoolLayout(8, 2, 4, 2, 16, torch.float32)
    host = WorkerConfig(cache=CacheConfig(kv_offload_bytes=10 * layout.page_bytes),
                        parallel=ParallelConfig(tensor_parallel_size=2))
    assert _num_offload_slots(host, layout) == 10
    files = host.model_copy(update={"cache": CacheConfig(kv_offload_bytes=10 * layout.page_bytes,
                                                         kv_offload_dir=str(tmp_path))})
    with pytest.raises(ValueError, match="--kv-offload-dir does not support tensor parallelism"):
        _num_offload_slots(files, layout)
