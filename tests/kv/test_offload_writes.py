"""The file tier's stores written behind on its I/O thread: the engine thread only stages the page,
loads queue after the writes of their slots, a reused slot ends with its newest page, and a store
with no free staging row, or whose write fails, is a counted miss."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import pytest
import torch

from pdserve.kv.offload import OffloadTier, PageLoad
from pdserve.kv.offload_file import FilePageStore
from pdserve.kv.offload_writes import SerialExecutor
from pdserve.metrics import Metrics

PAGE_BYTES = 4096
KEY_A = (b"a" * 16, 0)
KEY_B = (b"b" * 16, 0)
KEY_C = (b"c" * 16, 0)


class ManualExecutor(Executor):
    """The tier's one I/O thread, stepped by hand: jobs run oldest first, only when the test says."""

    runs_one_at_a_time = True

    def __init__(self):
        self.jobs: deque = deque()

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def run_next(self) -> None:
        future, fn, args, kwargs = self.jobs.popleft()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - handed to the future, as a real executor does
            future.set_exception(error)

    def run_all(self) -> None:
        while self.jobs:
            self.run_next()


def file_tier(tmp_path, num_slots: int = 4, num_staging_rows: int = 4, executor=None, device: str = "cpu"):
    pool = torch.randint(-128, 127, (8, PAGE_BYTES), dtype=torch.int8, device=device)
    store = FilePageStore(pool, num_slots * PAGE_BYTES, str(tmp_path), num_staging_rows)
    executor = executor if executor is not None else ManualExecutor()
    return OffloadTier(store, [0], executor=executor), store, pool, executor


def load(tier: OffloadTier, load_id: str, key, block_id: int):
    """Pin the key and start loading it into `block_id`, as the KV manager does."""
    tier.pin([key])
    tier.start_tier_read(load_id, [PageLoad(block_id, key[0], key[1], None)])


def test_the_engine_thread_only_stages_the_page_and_the_io_thread_writes_it(tmp_path, monkeypatch):
    executor = SerialExecutor()
    tier, store, pool, _ = file_tier(tmp_path, executor=executor)
    writers = []
    real_pwrite = os.pwrite

    def recording_pwrite(fd, data, offset):
        writers.append(threading.current_thread().name)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    tier.offer(3, KEY_A, None)
    assert tier.lookup(*KEY_A) is not None  # findable at once: a load would queue after the write
    deadline = time.monotonic() + 10
    while tier.stats.num_stores == 0 and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.01)
    assert writers and all(name.startswith("pdserve-kv-offload") for name in writers)
    assert threading.current_thread().name not in writers
    assert tier.stats.num_store_bytes == PAGE_BYTES and store.num_free_staging_rows == store.num_staging_rows
    executor.shutdown()
    store.close()


def test_nothing_reaches_the_file_before_the_io_thread_runs_the_write(tmp_path):
    tier, store, pool, executor = file_tier(tmp_path)
    tier.offer(3, KEY_A, None)
    assert os.path.getsize(store.path) == 0 and tier.stats.num_stores == 0
    assert store.num_free_staging_rows == store.num_staging_rows - 1
    executor.run_all()
    tier.poll()
    assert os.path.getsize(store.path) >= PAGE_BYTES and tier.stats.num_stores == 1
    store.close()


def test_a_load_right_after_a_store_of_the_same_slot_reads_the_new_bytes(tmp_path, device):
    tier, store, pool, executor = file_tier(tmp_path, device=device)  # on CUDA: pinned staging rows
    page = pool[3].clone()
    tier.offer(3, KEY_A, None)
    pool[3] = 0  # the pool reuses the block at once: the page was captured by the staging copy
    load(tier, "r1", KEY_A, 6)
    assert len(executor.jobs) == 2  # the write, then the read, on the one I/O thread
    executor.run_all()
    assert tier.poll().landed == ["r1"]
    assert torch.equal(pool[6], page)
    tier.check_invariants()
    store.close()


def test_a_slot_reused_while_its_write_is_queued_ends_with_the_newest_page_and_its_crc(tmp_path):
    tier, store, pool, executor = file_tier(tmp_path, num_slots=1)
    newest = pool[2].clone()
    tier.offer(1, KEY_A, None)
    tier.offer(2, KEY_B, None)  # the tier's LRU drops A and reuses its slot, A's write still queued
    assert tier.lookup(*KEY_A) is None and tier.lookup(*KEY_B) == 0
    executor.run_all()
    load(tier, "r1", KEY_B, 6)
    executor.run_all()
    assert tier.poll().landed == ["r1"]  # the read passed the CRC check: the CRC is the newest page's
    assert torch.equal(pool[6], newest)
    assert tier.stats.num_stores == 2 and tier.stats.num_failed_stores == 0
    tier.check_invariants()
    store.close()


def test_a_slot_whose_read_is_queued_is_not_reused_the_store_is_skipped(tmp_path):
    tier, store, pool, executor = file_tier(tmp_path, num_slots=1)
    page = pool[1].clone()
    tier.offer(1, KEY_A, None)
    load(tier, "r1", KEY_A, 6)
    tier.offer(2, KEY_B, None)  # A is pinned by its load: no slot for B
    assert tier.lookup(*KEY_B) is None and tier.stats.num_skipped_stores == 1
    executor.run_all()
    assert tier.poll().landed == ["r1"] and torch.equal(pool[6], page)
    store.close()


def test_a_store_that_finds_every_staging_row_busy_is_skipped_and_counted(tmp_path):
    tier, store, pool, executor = file_tier(tmp_path, num_slots=4, num_staging_rows=2)
    tier.offer(1, KEY_A, None)
    tier.offer(2, KEY_B, None)
    tier.offer(3, KEY_C, None)  # both rows wait for their writes: skipped, not waited for
    assert tier.lookup(*KEY_C) is None and tier.stats.num_skipped_stores == 1
    assert tier.num_pages == 2 and store.num_free_staging_rows == 0
    executor.run_all()
    tier.offer(3, KEY_C, None)  # the rows are free again
    assert tier.lookup(*KEY_C) is not None and tier.stats.num_skipped_stores == 1
    executor.run_all()
    tier.poll()
    assert tier.stats.num_stores == 3
    tier.check_invariants()
    store.close()


def full_disk(monkeypatch) -> None:
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)


def test_a_failed_write_is_a_store_that_did_not_happen(tmp_path, monkeypatch):
    tier, store, pool, executor = file_tier(tmp_path)
    full_disk(monkeypatch)
    tier.offer(3, KEY_A, None)
    executor.run_all()
    assert tier.lookup(*KEY_A) is None  # learnt of the failure before answering
    assert tier.stats.num_failed_stores == 1 and tier.stats.num_stores == 0 and tier.stats.num_store_bytes == 0
    assert store.num_free_staging_rows == store.num_staging_rows and tier.num_pages == 0
    tier.check_invariants()
    store.close()


def test_a_load_queued_behind_a_failed_write_fails_and_never_hands_over_the_bytes(tmp_path, monkeypatch):
    tier, store, pool, executor = file_tier(tmp_path)
    full_disk(monkeypatch)
    tier.offer(3, KEY_A, None)
    load(tier, "r1", KEY_A, 6)
    executor.run_all()
    results = tier.poll()
    assert results.failed == ["r1"] and results.landed == []
    assert tier.lookup(*KEY_A) is None and tier.stats.num_failed_stores == 1
    assert tier.stats.num_failed_loads == 1  # block 6 is never cached: its request recomputes
    tier.check_invariants()
    store.close()


def test_a_write_that_failed_before_the_slot_was_reused_does_not_drop_the_new_page(tmp_path, monkeypatch):
    tier, store, pool, executor = file_tier(tmp_path, num_slots=1)
    real_pwrite = os.pwrite
    full_disk(monkeypatch)
    tier.offer(1, KEY_A, None)
    tier.offer(2, KEY_B, None)  # reuses A's slot while A's write is queued
    executor.run_next()  # A's write fails
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    executor.run_next()  # B's succeeds
    assert tier.lookup(*KEY_B) == 0
    assert tier.stats.num_failed_stores == 1 and tier.stats.num_stores == 1
    store.close()


def test_the_io_executor_must_run_one_job_at_a_time(tmp_path):
    pool = torch.zeros((4, PAGE_BYTES), dtype=torch.int8)
    store = FilePageStore(pool, 2 * PAGE_BYTES, str(tmp_path))
    with ThreadPoolExecutor(2) as two_threads, pytest.raises(ValueError, match="one worker in order"):
        OffloadTier(store, [0], executor=two_threads)
    store.close()


def test_skipped_and_failed_stores_are_exported_by_reason():
    metrics = Metrics()
    metrics.offload.record_tier_activity(0, 0, 0, [], [], 0.0, num_busy_stores=3, num_failed_stores=2)
    value = metrics.registry.get_sample_value
    assert value("pdserve_kv_offload_skipped_stores_total", {"reason": "busy"}) == 3.0
    assert value("pdserve_kv_offload_skipped_stores_total", {"reason": "failed"}) == 2.0
