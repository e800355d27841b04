"""The tier's page stores (host memory; real files) and loads that run on an I/O thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import xxhash

from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadIOError, OffloadTier
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_writes import SerialExecutor
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from tests.kv.test_offload import BS, FakePages, compute, prompt

PAGE_BYTES = 4096


def pool_view(num_blocks: int = 8, device: str = "cpu") -> torch.Tensor:
    return torch.randint(-128, 127, (num_blocks, PAGE_BYTES), dtype=torch.int8).to(device)


def test_a_page_written_to_the_file_reads_back_into_another_block(tmp_path, device):
    pool = pool_view(device=device)
    store = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path))
    store.write(2, 5)
    original = pool[5].clone()
    store.read([2], [7])
    assert torch.equal(pool[7], original)
    assert os.path.getsize(store.path) >= 3 * PAGE_BYTES
    store.close()


def test_staged_pages_read_back_in_one_load_of_more_pages_than_read_rows(tmp_path, device):
    """Staging rows and, on CUDA, the two pinned read rows each page passes through on its way to the pool."""
    pool = pool_view(12, device)
    store = FilePageStore(pool, 6 * PAGE_BYTES, str(tmp_path), num_staging_rows=2)
    for slot, block_id in enumerate((0, 1, 2, 3, 4)):
        store.write_staged(slot, store.stage(block_id))
    assert store.num_free_staging_rows == 2
    expected = pool[:5].clone()
    pool[5:10] = 0
    store.read([0, 1, 2, 3, 4], [9, 8, 7, 6, 5])
    assert torch.equal(pool[5:10], expected.flip(0))
    store.close()


def test_a_corrupt_or_never_written_slot_fails_the_read(tmp_path, device):
    pool = pool_view(device=device)
    store = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path))
    store.write(1, 3)
    store.write(2, 2)
    with open(store.path, "r+b") as f:
        f.seek(PAGE_BYTES + 100)
        f.write(b"\xff\x00\xff")
    with pytest.raises(OffloadIOError, match="slot 1 is torn or corrupt"):
        store.read([2, 1], [4, 5])
    with pytest.raises(OffloadIOError, match="slot 0"):
        store.read([0], [4])
    store.read([2], [6])  # the store still serves its sound pages
    assert torch.equal(pool[6], pool[2])
    store.close()


def test_two_workers_cannot_share_a_directory_and_a_restart_wipes_it(tmp_path):
    pool = pool_view()
    first = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path))
    first.write(0, 1)
    with pytest.raises(ValueError, match="in use"):
        FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path))
    first.close()
    again = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path))
    assert os.path.getsize(again.path) == 0
    with pytest.raises(OffloadIOError):
        again.read([0], [2])
    again.close()


def test_closing_a_tier_lets_its_writes_finish_and_frees_the_directory(tmp_path):
    pool = pool_view()
    io = SerialExecutor()
    tier = OffloadTier(FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path)), [0], executor=io)
    tier.offer(1, (b"h" * 8, 0), None)  # staged; written on the I/O thread
    tier.close()
    with pytest.raises(RuntimeError):  # the I/O thread is gone, after the write it was given
        io.submit(print)
    assert os.path.getsize(os.path.join(tmp_path, "pages.bin")) == PAGE_BYTES
    FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path)).close()  # the lock was released


class GatedPages(FakePages):
    """Reads wait until the test opens the gate: a load stays in flight as long as it likes."""

    def __init__(self, num_blocks: int, num_slots: int):
        super().__init__(num_blocks, num_slots)
        self.gate = threading.Event()

    def read(self, slots, block_ids):
        assert self.gate.wait(10)
        super().read(slots, block_ids)


def poll_until(manager: KVCacheManager, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = manager.poll_offload()
        if results.landed or results.failed:
            return results
        time.sleep(0.01)
    raise TimeoutError


def threaded_manager(num_blocks=9, num_slots=16):
    pages = GatedPages(num_blocks, num_slots)
    tier = OffloadTier(pages, [0], executor=SerialExecutor())
    return KVCacheManager(plan_groups([FullAttentionSpec()]), num_blocks, BS, offload=tier), pages


def test_a_threaded_load_lands_only_when_its_read_is_done():
    manager, pages = threaded_manager()
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    assert manager.allocate_slots("c", 16, 1, hit) and manager.start_tier_read("c")
    assert not manager.poll_offload().landed
    pages.gate.set()
    assert poll_until(manager).landed == ["c"]
    manager.check_invariants()


def test_a_load_wakes_its_waiter_when_it_has_a_result_and_not_before():
    manager, pages = threaded_manager()
    woken = threading.Event()
    manager.offload.wake_on_results(woken.set)
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    assert manager.allocate_slots("c", 16, 1, hit) and manager.start_tier_read("c")
    assert not woken.is_set()  # the read waits at the gate
    pages.gate.set()
    assert woken.wait(10)  # called from the I/O thread as the read ended
    assert manager.poll_offload().landed == ["c"]  # so the poll it prompts finds the result
    manager.check_invariants()


def test_a_request_that_ends_while_its_pages_load_keeps_its_blocks_until_the_read_ends():
    manager, pages = threaded_manager()
    first = compute(manager, pages, "a", prompt(17, 0))
    compute(manager, pages, "b", prompt(32, 1000))
    hit = manager.find_prefix(first, 17)
    assert manager.allocate_slots("c", 16, 1, hit) and manager.start_tier_read("c")
    in_use = manager.pool.num_in_use
    manager.free("c")  # an abort: the read still writes those blocks
    assert manager.pool.num_in_use == in_use
    manager.check_invariants()
    pages.gate.set()
    deadline = time.monotonic() + 10
    while manager.pool.num_in_use and time.monotonic() < deadline:
        assert manager.poll_offload().landed == []  # nobody waits for it any more
        time.sleep(0.01)
    assert manager.pool.num_in_use == 0
    manager.check_invariants()
    # The same request id may come back at once and load again.
    hit = manager.find_prefix(first, 17)
    assert manager.allocate_slots("c", hit.num_tokens, 17 - hit.num_tokens, hit)
    if manager.start_tier_read("c"):
        assert poll_until(manager).landed == ["c"]


def test_the_host_store_copies_whole_pages_both_ways(device):
    from pdserve.kv.offload_host import HostPageStore

    pool = pool_view(device=device)
    store = HostPageStore(pool, 3 * PAGE_BYTES + 5)
    assert store.num_slots == 3 and store.medium == "cpu"
    store.write(0, 1)
    store.write(2, 6)
    expected = pool[[1, 6]].clone()
    store.read([0, 2], [3, 4])
    assert torch.equal(pool[[3, 4]], expected)
    store.read([], [])
    with pytest.raises(OffloadIOError):
        store.read([0], [3, 4])
    with pytest.raises(ValueError):
        HostPageStore(pool, PAGE_BYTES - 1)


def test_the_directory_is_made_private_and_one_of_another_owner_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    FilePageStore(pool_view(), 4 * PAGE_BYTES, str(shared)).close()
    assert os.stat(shared).st_mode & 0o777 == 0o700
    fresh = tmp_path / "fresh"
    FilePageStore(pool_view(), 4 * PAGE_BYTES, str(fresh)).close()
    assert os.stat(fresh).st_mode & 0o777 == 0o700
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(shared).st_uid + 1)  # as if another user owned it
    with pytest.raises(ValueError, match="owned by uid"):
        FilePageStore(pool_view(), 4 * PAGE_BYTES, str(shared))


def test_a_planted_link_at_the_pages_file_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "tier"
    directory.mkdir(mode=0o700)
    os.symlink(victim, directory / "pages.bin")
    store = FilePageStore(pool_view(), 4 * PAGE_BYTES, str(directory))
    store.write(0, 1)
    store.close()
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(directory / "pages.bin")


def test_a_link_at_the_lock_is_refused(tmp_path):
    directory = tmp_path / "tier"
    directory.mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", directory / "lock")
    with pytest.raises(ValueError, match="lock"):
        FilePageStore(pool_view(), 4 * PAGE_BYTES, str(directory))
    assert not (tmp_path / "elsewhere").exists()


def test_the_page_checksum_is_keyed_per_store(tmp_path):
    """A page whose plain XXH3 an attacker can compute does not pass: the sum is keyed with a secret
    drawn when the store opens, so two stores sum the same page differently."""
    pool = pool_view()
    first = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path / "a"))
    second = FilePageStore(pool, 4 * PAGE_BYTES, str(tmp_path / "b"))
    page = pool[1].numpy()
    assert first._checksum(page) != second._checksum(page)
    assert first._checksum(page) != xxhash.xxh3_64_intdigest(page)
    first.close()
    second.close()
