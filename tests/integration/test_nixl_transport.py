"""NixlTransport between two real processes on one host: real NIXL over UCX, on host memory
in CI and on GPU memory too where CUDA is present (the `device` fixture).

The prefill side runs in a spawned child that owns a pool filled with a known
pattern, publishes its PeerInfo as JSON (as the HTTP handshake would) and
forwards every notification it receives; the decode side runs in the test.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.transport import PeerInfo, TransferError, TransferState
from tests.devices import cuda_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

# 2 layer slots x K/V x 16 tokens x 2 heads x 8 dims x fp32 = 4096-byte pages
LAYOUT = dict(group_size=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
NUM_PREFILL_BLOCKS, NUM_DECODE_BLOCKS = 40, 24
CHILD_START_TIMEOUT_S = 30.0
MAX_WAIT_S = 10.0


def pattern(num_blocks: int, page_bytes: int, seed: int) -> torch.Tensor:
    """Distinct bytes per page and per seed, so a wrong page or a stale process shows."""
    values = torch.arange(num_blocks * page_bytes, dtype=torch.int64) * 7 + seed * 131
    values += torch.arange(num_blocks, dtype=torch.int64).repeat_interleave(page_bytes) * 1009
    return values.remainder(251).to(torch.int8).view(num_blocks, page_bytes)


def run_prefill(agent_name: str, epoch: str, seed: int, device: str, out: multiprocessing.Queue,
                stop: multiprocessing.Event) -> None:
    """Child process: serve a patterned pool and forward notifications until told to stop."""
    layout = KVPoolLayout(num_blocks=NUM_PREFILL_BLOCKS, **LAYOUT)
    view = layout.canonical_view(layout.allocate(device))
    view.copy_(pattern(layout.num_blocks, layout.page_bytes, seed))
    if view.is_cuda:
        torch.cuda.synchronize()  # the pattern is in place before a peer can read it
    transport = NixlTransport(view, agent_name)
    out.put(json.dumps(transport.local_peer_info("prefill-engine", epoch).to_dict()))
    while not stop.is_set():
        for message in transport.poll_notifications():
            out.put(message)
        time.sleep(0.002)
    transport.close()


class PrefillProcess:
    def __init__(self, agent_name: str, epoch: str, seed: int, device: str):
        context = multiprocessing.get_context("spawn")
        self.messages = context.Queue()
        self.stop = context.Event()
        self.process = context.Process(target=run_prefill, daemon=True,
                                       args=(agent_name, epoch, seed, device, self.messages, self.stop))
        self.process.start()
        self.peer_info = PeerInfo.from_dict(json.loads(self.messages.get(timeout=CHILD_START_TIMEOUT_S)))

    def next_message(self, timeout_s: float = MAX_WAIT_S) -> bytes:
        return self.messages.get(timeout=timeout_s)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=MAX_WAIT_S)

    def shutdown(self) -> None:
        self.stop.set()
        self.process.join(timeout=MAX_WAIT_S)
        if self.process.is_alive():
            self.kill()


@pytest.fixture(scope="module")
def prefill(device):
    child = PrefillProcess(f"prefill-agent-a-{device}", epoch="epoch-1", seed=1, device=device)
    yield child
    child.shutdown()


@pytest.fixture
def decode(device):
    layout = KVPoolLayout(num_blocks=NUM_DECODE_BLOCKS, **LAYOUT)
    view = layout.canonical_view(layout.allocate(device))
    transport = NixlTransport(view, f"decode-agent-{os.getpid()}-{time.monotonic_ns()}")
    yield transport, view
    transport.close()


def wait(transport: NixlTransport, handle) -> TransferState:
    deadline = time.monotonic() + MAX_WAIT_S
    while transport.poll(handle) is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    return handle.state


def test_read_copies_scattered_remote_pages_into_other_local_pages_exactly(prefill, decode):
    transport, view = decode
    key = transport.connect(prefill.peer_info)
    handle = read_and_check(transport, view, key, [3, 17, 5, 9, 1], [38, 2, 11, 7, 20])
    assert handle.num_blocks == 5  # nothing adjacent on both sides: one descriptor a page


def read_and_check(transport: NixlTransport, view: torch.Tensor, key: str, local_ids: list[int],
                   remote_ids: list[int]):
    """Read, wait, release; every local page now holds its remote page and no other page changed."""
    handle = transport.start_read(key, local_ids, remote_ids, b"")
    assert wait(transport, handle) is TransferState.DONE, handle.error
    assert transport.release(handle)
    expected = pattern(NUM_PREFILL_BLOCKS, transport.page_bytes, seed=1)
    for local_id, remote_id in zip(local_ids, remote_ids):
        assert torch.equal(view[local_id].cpu(), expected[remote_id]), f"local {local_id} <- remote {remote_id}"
    untouched = [b for b in range(NUM_DECODE_BLOCKS) if b not in local_ids]
    assert not view[untouched].any()
    return handle


def test_prefill_receives_the_notification_after_the_read_lands(prefill, decode):
    transport, view = decode
    key = transport.connect(prefill.peer_info)
    handle = transport.start_read(key, [4, 6], [30, 31], b"req-7:read-done")
    assert wait(transport, handle) is TransferState.DONE, handle.error
    assert prefill.next_message() == b"req-7:read-done"
    assert transport.release(handle)


def test_send_message_and_empty_read_notify_prefill_without_moving_pages(prefill, decode):
    transport, view = decode
    key = transport.connect(prefill.peer_info)
    transport.send_message(key, b"req-8:free")
    assert prefill.next_message() == b"req-8:free"
    handle = transport.start_read(key, [], [], b"req-9:prefix-hit")
    assert handle.state is TransferState.DONE
    assert prefill.next_message() == b"req-9:prefix-hit"
    assert not view.any()


def test_connect_is_idempotent_and_checks_page_size(prefill, decode):
    transport, _ = decode
    key = transport.connect(prefill.peer_info)
    assert transport.connect(prefill.peer_info) == key
    info = prefill.peer_info.to_dict()
    info.update(epoch="other", page_bytes=transport.page_bytes * 2)
    with pytest.raises(TransferError, match="pages of"):
        transport.connect(PeerInfo.from_dict(info))


def test_read_from_a_killed_peer_fails_within_bounded_time_and_a_restart_is_readable(decode, device):
    transport, view = decode
    doomed = PrefillProcess("prefill-agent-b", epoch="epoch-1", seed=2, device=device)
    key = transport.connect(doomed.peer_info)
    doomed.kill()
    started_s = time.monotonic()
    handle = transport.start_read(key, [1, 2], [3, 4], b"never")
    assert wait(transport, handle) is TransferState.FAILED
    assert time.monotonic() - started_s < MAX_WAIT_S
    assert handle.error
    assert transport.release(handle)
    with pytest.raises(TransferError):
        transport.send_message(key, b"free")
    # A new handshake naming the dead process fails fast at connect (UCX finds
    # the address unreachable while loading the metadata, or the warm-up read fails).
    stale = doomed.peer_info.to_dict()
    stale["epoch"] = "epoch-stale"
    started_s = time.monotonic()
    with pytest.raises(TransferError):
        transport.connect(PeerInfo.from_dict(stale))
    assert time.monotonic() - started_s < MAX_WAIT_S
    # Same engine and agent name, new epoch: the old connection is replaced
    # (NIXL refuses to load new metadata under a name it already holds).
    restarted = PrefillProcess("prefill-agent-b", epoch="epoch-2", seed=3, device=device)
    try:
        new_key = transport.connect(restarted.peer_info)
        assert new_key != key
        handle = transport.start_read(new_key, [1], [3], b"")
        assert wait(transport, handle) is TransferState.DONE, handle.error
        assert torch.equal(view[1].cpu(), pattern(NUM_PREFILL_BLOCKS, transport.page_bytes, seed=3)[3])
    finally:
        restarted.shutdown()


def test_pool_is_registered_with_its_memory_type_and_device_index(prefill, decode, device):
    transport, view = decode
    info = transport.local_peer_info("decode-engine", "epoch")
    assert (info.mem_type, info.device_id) == (("VRAM", view.get_device()) if device == "cuda" else ("DRAM", 0))
    assert info.base_address == view.data_ptr()
    assert (prefill.peer_info.mem_type, prefill.peer_info.device_id) == (info.mem_type, info.device_id)


def _two_gpus() -> bool:
    return cuda_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
def test_pools_on_two_gpus_carry_their_own_device_ids_and_read_across():
    """Prefill on cuda:0, decode on cuda:1 (as `pdserve up --prefill-device cuda:0 --decode-device cuda:1`)."""
    child = PrefillProcess("prefill-agent-gpu0", epoch="epoch-1", seed=4, device="cuda:0")
    layout = KVPoolLayout(num_blocks=NUM_DECODE_BLOCKS, **LAYOUT)
    view = layout.canonical_view(layout.allocate("cuda:1"))
    transport = NixlTransport(view, f"decode-agent-gpu1-{os.getpid()}")
    try:
        assert (child.peer_info.mem_type, child.peer_info.device_id) == ("VRAM", 0)
        assert transport.local_peer_info("d", "e").device_id == 1
        handle = transport.start_read(transport.connect(child.peer_info), [2, 7], [9, 30], b"")
        assert wait(transport, handle) is TransferState.DONE, handle.error
        expected = pattern(NUM_PREFILL_BLOCKS, transport.page_bytes, seed=4)
        assert torch.equal(view[2].cpu(), expected[9]) and torch.equal(view[7].cpu(), expected[30])
    finally:
        transport.close()
        child.shutdown()


def test_pages_adjacent_on_both_sides_move_as_one_descriptor_and_land_exactly(prefill, decode):
    transport, view = decode
    key = transport.connect(prefill.peer_info)
    handle = read_and_check(transport, view, key, [4, 5, 6, 7, 12, 13, 2], [30, 31, 32, 33, 8, 20, 21])
    assert handle.num_blocks == 4  # descriptors: runs of 4, 1, 1 and 1 pages
