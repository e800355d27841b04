"""NixlTransport between two real processes on one host: real NIXL over UCX, on host memory
in CI and on GPU memory too where CUDA is present (the `device` fixture).

The prefill side runs in a spawned child that owns a pool filled with a known
pattern, publishes its PeerInfo as JSON (as the HTTP handshake would) and
forwards every notification it receives; the decode side runs in the test.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import time
import weakref

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.descriptor_runs import MIN_DESCRIPTORS_SAVED
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.token_units import unit_chunk_ids, unit_geometry
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


# ---- pages of different block sizes: unit chunks, direct and staged reads ---------------------------

# Same heads, slots and head size on both sides; only the block size differs. "few-rows": 8 rows of
# 512-byte units (at most 16 chunks a page: prepared lists); "many-rows": 48 rows (96 chunks in a
# 32-token page: described per read).
ROW_LAYOUTS = {"few-rows": dict(group_size=2, num_kv_heads=2, head_dim=8, dtype=torch.float32),
               "many-rows": dict(group_size=12, num_kv_heads=2, head_dim=8, dtype=torch.float32)}
BLOCK_SIZES = (16, 32)
NUM_BLOCK_TEST_BLOCKS = 24


def word_pattern(num_blocks: int, page_bytes: int, tag: int) -> torch.Tensor:
    """int64 word i of the pool holds i + tag << 40: every 8 bytes of every pool differ."""
    words = torch.arange(num_blocks * page_bytes // 8, dtype=torch.int64) + (tag << 40)
    return words.view(torch.int8).view(num_blocks, page_bytes)


def pool_tag(layout_name: str, block_size: int) -> int:
    return 1 + sorted(ROW_LAYOUTS).index(layout_name) * 2 + BLOCK_SIZES.index(block_size)


def block_layout(layout_name: str, block_size: int) -> KVPoolLayout:
    return KVPoolLayout(num_blocks=NUM_BLOCK_TEST_BLOCKS, block_size=block_size, **ROW_LAYOUTS[layout_name])


def run_block_size_prefill(device: str, out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Child: one patterned pool per (row layout, block size), each with its own agent."""
    transports, published = [], {}
    for name in ROW_LAYOUTS:
        for block_size in BLOCK_SIZES:
            layout = block_layout(name, block_size)
            view = layout.canonical_view(layout.allocate(device))
            view.copy_(word_pattern(layout.num_blocks, layout.page_bytes, pool_tag(name, block_size)))
            if view.is_cuda:
                torch.cuda.synchronize()
            transport = NixlTransport(view, f"prefill-blocks-{name}-{block_size}-{device}")
            transports.append(transport)
            published[f"{name}/{block_size}"] = transport.local_peer_info(f"prefill-{name}-{block_size}",
                                                                          "epoch-1").to_dict()
    out.put(json.dumps(published))
    while not stop.is_set():
        for transport in transports:
            transport.poll_notifications()
        time.sleep(0.002)
    for transport in transports:
        transport.close()


@pytest.fixture(scope="module")
def block_prefill(device):
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    process = context.Process(target=run_block_size_prefill, args=(device, out, stop), daemon=True)
    process.start()
    published = {key: PeerInfo.from_dict(info)
                 for key, info in json.loads(out.get(timeout=CHILD_START_TIMEOUT_S)).items()}
    yield published
    stop.set()
    process.join(timeout=MAX_WAIT_S)
    if process.is_alive():
        process.kill()


def connect_chunked(transport: NixlTransport, peer: PeerInfo, chunk_bytes: int) -> str:
    key = transport.begin_connect(peer, chunk_bytes=chunk_bytes)
    deadline = time.monotonic() + MAX_WAIT_S
    while (state := transport.poll_connect(key)) is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert state is TransferState.DONE, transport.connect_failure(key)
    return key


def prompt_chunk_pairs(geometry, remote_blocks: list[int], local_blocks: list[int], remote_block_size: int,
                       local_block_size: int, num_tokens: int, rows: int):
    """Unit k covers tokens [k*u, (k+1)*u) (u the smaller block size); every row of it is one chunk pair."""
    unit = min(remote_block_size, local_block_size)
    tokens = range(0, num_tokens, unit)
    remote_units = [remote_blocks[t // remote_block_size] * (remote_block_size // unit)
                    + (t % remote_block_size) // unit for t in tokens]
    local_units = [local_blocks[t // local_block_size] * (local_block_size // unit)
                   + (t % local_block_size) // unit for t in tokens]
    return (unit_chunk_ids(geometry.local, local_units, 0, rows),
            unit_chunk_ids(geometry.remote, remote_units, 0, rows))


def check_tokens(view: torch.Tensor, local_blocks: list[int], local_block_size: int, remote: torch.Tensor,
                 remote_blocks: list[int], remote_block_size: int, num_tokens: int, rows: int) -> None:
    """Token t of every row sits where each side's block table puts it; nothing else was written."""
    local_rows = view.cpu().view(view.shape[0], rows, local_block_size, -1)
    remote_rows = remote.view(remote.shape[0], rows, remote_block_size, -1)
    written = torch.zeros(local_rows.shape[:3], dtype=torch.bool)
    for t in range(num_tokens):
        block, slot = local_blocks[t // local_block_size], t % local_block_size
        expected = remote_rows[remote_blocks[t // remote_block_size], :, t % remote_block_size]
        assert torch.equal(local_rows[block, :, slot], expected), f"token {t}: local block {block} slot {slot}"
        written[block, :, slot] = True
    assert not local_rows[~written].any(), "bytes outside the prompt's tokens were written"


def expected_descriptors(remote_block_size: int, local_block_size: int, num_tokens: int, rows: int) -> tuple[int, int]:
    """(direct, staged) descriptors with no block adjacent to another on either side: one per (unit,
    row) directly; staged, one per remote page read whole and one per row of a page read in part."""
    unit = min(remote_block_size, local_block_size)
    direct = -(-num_tokens // unit) * rows
    whole, rest = divmod(num_tokens, remote_block_size)
    return direct, whole + (rows if rest else 0)


def spaced_blocks(count: int, first: int) -> list[int]:
    """Block ids two apart, out of order: never adjacent, so no run merges on their side."""
    ids = list(range(first, first + 2 * count, 2))
    return ids[1::2] + ids[::2]


@pytest.mark.parametrize("layout_name", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("remote_block_size,local_block_size", [(16, 32), (32, 16)])
@pytest.mark.parametrize("read_mode", ["direct", "staged", "auto"])
@pytest.mark.parametrize("num_tokens", [96, 80])
def test_reads_between_block_sizes_put_every_token_of_every_row_in_place(
        block_prefill, device, layout_name, remote_block_size, local_block_size, read_mode, num_tokens):
    local_layout = block_layout(layout_name, local_block_size)
    remote_layout = block_layout(layout_name, remote_block_size)
    rows = local_layout.num_kv_heads * local_layout.group_size * 2
    view = local_layout.canonical_view(local_layout.allocate(device))
    factor = 6.0  # 512-byte units: within the descriptor size limit, so the factor decides
    transport = NixlTransport(view, f"decode-blocks-{os.getpid()}-{time.monotonic_ns()}", read_mode=read_mode,
                              staged_descriptor_factor=factor, staged_max_descriptor_bytes=4096)
    try:
        geometry = unit_geometry(local_layout.page_bytes, rows, remote_layout.page_bytes, rows)
        key = connect_chunked(transport, block_prefill[f"{layout_name}/{remote_block_size}"], geometry.unit_bytes)
        prepared = max(local_layout.page_bytes, remote_layout.page_bytes) // geometry.unit_bytes <= 64
        assert (geometry.unit_bytes in transport.prepared_chunk_bytes) == prepared
        remote_blocks = spaced_blocks(-(-num_tokens // remote_block_size), first=3)
        local_blocks = spaced_blocks(-(-num_tokens // local_block_size), first=2)
        local_ids, remote_ids = prompt_chunk_pairs(geometry, remote_blocks, local_blocks, remote_block_size,
                                                   local_block_size, num_tokens, rows)
        handle = transport.start_read(key, local_ids, remote_ids, b"")
        assert wait(transport, handle) is TransferState.DONE, handle.error
        assert transport.release(handle)
        direct, staged = expected_descriptors(remote_block_size, local_block_size, num_tokens, rows)
        if read_mode == "auto":
            pays = direct >= factor * staged and direct - staged >= MIN_DESCRIPTORS_SAVED
            read_mode = "staged" if pays else "direct"
        assert handle.num_blocks == {"direct": direct, "staged": staged}[read_mode]
        assert handle.num_bytes == len(local_ids) * geometry.unit_bytes
        assert (transport.staging_bytes > 0) == (read_mode == "staged")
        remote = word_pattern(remote_layout.num_blocks, remote_layout.page_bytes,
                              pool_tag(layout_name, remote_block_size))
        check_tokens(view, local_blocks, local_block_size, remote, remote_blocks, remote_block_size, num_tokens,
                     rows)
    finally:
        transport.close()


class AgentFailingAfterTheData:
    """Wraps a NIXL agent: a read runs for real (its bytes reach the staging buffer), then reports ERR."""

    def __init__(self, agent):
        self._agent = agent

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def transfer(self, xfer, *args):
        status = self._agent.transfer(xfer, *args)
        return "PROC" if status == "DONE" else status

    def check_xfer_state(self, xfer):
        status = self._agent.check_xfer_state(xfer)
        return "ERR" if status == "DONE" else status


def test_staged_reads_reuse_their_buffer_and_a_failed_one_leaves_the_pool_untouched(block_prefill, device):
    layout_name, remote_block_size, local_block_size = "many-rows", 16, 32
    local_layout = block_layout(layout_name, local_block_size)
    remote_layout = block_layout(layout_name, remote_block_size)
    rows = local_layout.num_kv_heads * local_layout.group_size * 2
    view = local_layout.canonical_view(local_layout.allocate(device))
    transport = NixlTransport(view, f"decode-staged-{os.getpid()}-{time.monotonic_ns()}", read_mode="staged")
    try:
        geometry = unit_geometry(local_layout.page_bytes, rows, remote_layout.page_bytes, rows)
        key = connect_chunked(transport, block_prefill[f"{layout_name}/{remote_block_size}"], geometry.unit_bytes)
        remote_blocks, local_blocks = spaced_blocks(6, first=3), spaced_blocks(3, first=2)
        local_ids, remote_ids = prompt_chunk_pairs(geometry, remote_blocks, local_blocks, remote_block_size,
                                                   local_block_size, 96, rows)
        real_agent = transport._agent
        transport._agent = AgentFailingAfterTheData(real_agent)
        handle = transport.start_read(key, local_ids, remote_ids, b"")
        assert wait(transport, handle) is TransferState.FAILED
        assert transport.release(handle)
        assert not view.any(), "a failed staged read wrote into the pool"
        held = transport.staging_bytes
        assert held > 0
        transport._agent = real_agent
        for _ in range(3):
            view.zero_()
            handle = transport.start_read(key, local_ids, remote_ids, b"")
            assert wait(transport, handle) is TransferState.DONE, handle.error
            assert transport.release(handle)
            assert transport.staging_bytes == held  # the same buffer, every time
        remote = word_pattern(remote_layout.num_blocks, remote_layout.page_bytes,
                              pool_tag(layout_name, remote_block_size))
        check_tokens(view, local_blocks, local_block_size, remote, remote_blocks, remote_block_size, 96, rows)
    finally:
        transport.close()
    assert transport.staging_bytes == 0


def test_a_staged_read_from_a_killed_peer_fails_and_writes_nothing(device):
    layout = KVPoolLayout(num_blocks=NUM_DECODE_BLOCKS, **LAYOUT)
    view = layout.canonical_view(layout.allocate(device))
    transport = NixlTransport(view, f"decode-killed-{os.getpid()}-{time.monotonic_ns()}", read_mode="staged")
    doomed = PrefillProcess("prefill-agent-staged", epoch="epoch-1", seed=5, device=device)
    try:
        key = transport.connect(doomed.peer_info)
        doomed.kill()
        handle = transport.start_read(key, [1, 3, 5], [4, 2, 9], b"never")
        assert wait(transport, handle) is TransferState.FAILED
        assert handle.error
        assert transport.release(handle)
        assert not view.any()
    finally:
        transport.close()
        doomed.shutdown()


def test_a_closed_transport_is_freed_without_the_cycle_collector(device):
    """No reference cycle through the transport: left to the cyclic collector, NIXL's objects are
    finalized in any order, and that aborted the process."""
    layout = KVPoolLayout(num_blocks=4, **LAYOUT)
    transport = NixlTransport(layout.canonical_view(layout.allocate(device)), f"decode-freed-{os.getpid()}")
    transport.close()
    freed = weakref.ref(transport)
    gc.disable()
    try:
        del transport
        assert freed() is None
    finally:
        gc.enable()
