"""KVTransport over NIXL (UCX backend): the only module of pdserve that imports nixl (an agent process imports
the backend module this one names).

Invariant: the pool's canonical view is registered once as one region; a READ moves chunks (whole pages,
or the `chunk_bytes` pieces of `begin_connect`) and the handle is DONE only once every chunk is in place.

    local pool (canonical int8 view [num_blocks, page_bytes], one NIXL region)
    base                                                     base + num_blocks*page_bytes
    +-----------+-----------+-----------+-----------+-----+-----------+
    | page 0    | page 1    | page 2    | page 3    | ... | page N-1  |   registered once
    +-----------+-----------+-----------+-----------+-----+-----------+
    desc 0      desc 1      desc 2      desc 3            desc N-1        local dlist, prepared once
    (addr = base + b*page_bytes, len = page_bytes, dev)

    remote pool (from PeerInfo: base_address, num_blocks, page_bytes, mem_type)
    +-----------+-----------+-----------+-----------+-----+-----------+
    | page 0    | page 1    | page 2    | page 3    | ... | page M-1  |
    +-----------+-----------+-----------+-----------+-----+-----------+
    desc 0 ...                                            desc M-1        remote dlist, prepared at connect

    start_read(local=[5, 9], remote=[2, 3]) = make_prepped_xfer("READ",
        local dlist, indices [5, 9], remote dlist, indices [2, 3], notif)
        -> local page 5 <- remote page 2, local page 9 <- remote page 3,
           then the notification reaches the remote agent.

Direct reads: one descriptor per run of chunks consecutive on both sides (pdserve/transfer/
descriptor_runs.py), straight into the pool. Descriptor lists are prepared at connect only for
coarse chunks (at most MAX_PREPPED_CHUNKS_PER_PAGE per page on both sides: whole pages, head
ranges); finer chunks are described per read, from numpy arrays.

Staged reads (between pages of different block sizes): pdserve/transfer/staged_copy.py.

`read_mode` "auto" stages a read when staging cuts its descriptors by `staged_descriptor_factor`
and its direct descriptors are small (`staged_max_descriptor_bytes`): measured, the crossover is
set by the descriptor size, not by the factor alone (docs/benchmarks.md, "KV pulls between block
sizes"); "direct" and "staged" force one way (benchmarks, tests). A staged read that fails
copies nothing into the pool. Staging buffers are reused (pdserve/transfer/staging.py); on
CUDA the handle is DONE, and the buffer free, only once the copy's event completed.

Agent isolation (`isolated=True`, host-memory pools): the agent runs in its own process
(pdserve/transfer/agent_client.py), so a crash inside NIXL or UCX costs the reads in flight, not
the engine. Its death is noticed at the next call; the reads it ran fail, its peers are dropped,
and a replacement with a new name and metadata starts (pdserve/transfer/agent_restart.py; the
pool is registered with it on a helper thread, never the engine's); `generation` counts them, so
the worker can advertise the new identity.

NIXL raises its own exception classes (no common base beyond Exception) from C++ bindings; every call
into the agent is therefore wrapped, and a failure becomes a TransferError or a FAILED handle, never a crash.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from pdserve.transfer.agent_client import DEFAULT_CALL_TIMEOUT_S, AddressTaken, IsolatedAgent
from pdserve.transfer.agent_restart import AgentRestart
from pdserve.transfer.descriptor_runs import (
    DEFAULT_STAGED_DESCRIPTOR_FACTOR, DEFAULT_STAGED_MAX_DESCRIPTOR_BYTES, DirectRuns, StagedRuns, check_ids,
    check_read_mode, choose_runs, chunk_descriptors, run_descriptors)
from pdserve.transfer.nixl_records import AgentRegistration, ConnectedPeer, ReadInFlight, fail_read
from pdserve.transfer.read_steps import DEFAULT_SETTLE_S, ReadSpec, check_read_op, check_settle_s, reads_of
from pdserve.transfer.staged_copy import Scatter, allocate_host_or_device, copy_out_of_staging
from pdserve.transfer.staging import StagingBuffer, StagingBuffers
from pdserve.transfer.ucx_environment import allow_cuda_ipc_reads
from pdserve.transfer.transport import (
    PeerInfo, TransferError, TransferHandle, TransferState, num_chunks, wait_connected)

logger = logging.getLogger(__name__)

_LOCAL_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for "the local side of a prepared list"
_WARM_UP_BYTES = 64
_ADDRESS_ATTEMPTS = 4  # agent processes tried at start-up when one's layout took the pool's addresses
_AGENT_START_TIMEOUT_S = 60.0  # the first agent process, at worker start-up (importing nixl included)
MAX_PREPPED_CHUNKS_PER_PAGE = 64  # head-range chunks of the TP path; never a pool of (unit, row) chunks
DEFAULT_STAGING_IDLE_BYTES = 1 << 30  # staging buffers kept for reuse between reads


class NixlTransport:
    """KVTransport whose peers are NIXL agents in other processes.

    `progress_thread` starts NIXL's background progress thread. It is off by default because it
    keeps a CPU core half busy even when idle; without it, NIXL makes progress only inside calls
    into the agent, so the engine loop must call `poll_notifications` every step on both roles
    (and `poll` while reads are pending). `connect_timeout_s` bounds the blocking `connect` (tools
    and tests); the engine uses `begin_connect`/`poll_connect` and its own deadline.
    `read_mode`, `staged_descriptor_factor` and `staged_max_descriptor_bytes` choose between direct
    and staged reads (pdserve/transfer/descriptor_runs.py, `choose_runs`); `staging_idle_bytes`
    bounds the staging memory kept idle between reads. `read_op` and `read_settle_s`: how a read
    crosses to its agent (pdserve/transfer/read_steps.py).
    """

    def __init__(self, pool_canonical_view: torch.Tensor, agent_name: str, *, progress_thread: bool = False,
                 connect_timeout_s: float = 5.0, read_mode: str = "auto",
                 staged_descriptor_factor: float = DEFAULT_STAGED_DESCRIPTOR_FACTOR,
                 staged_max_descriptor_bytes: int = DEFAULT_STAGED_MAX_DESCRIPTOR_BYTES,
                 staging_idle_bytes: int = DEFAULT_STAGING_IDLE_BYTES, isolated: bool = False,
                 agent_call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 on_agent_restart: Optional[Callable[[], None]] = None, read_op: str = "single",
                 read_settle_s: float = DEFAULT_SETTLE_S):
        view = pool_canonical_view
        self._read_op, self._read_settle_s = check_read_op(read_op), check_settle_s(read_settle_s)
        if view.dim() != 2 or view.dtype != torch.int8 or not view.is_contiguous():
            raise ValueError("pool_canonical_view must be a contiguous int8 [num_blocks, page_bytes] tensor")
        check_read_mode(read_mode, staged_descriptor_factor)
        if isolated and view.is_cuda:
            raise ValueError("an isolated NIXL agent serves host-memory pools only (GPU pools: isolated=False)")
        self._read_mode = read_mode
        self._staged_factor = staged_descriptor_factor
        self._staged_max_descriptor_bytes = staged_max_descriptor_bytes
        self._staging_idle_bytes = staging_idle_bytes
        self._view = view  # keeps the registered memory alive
        self._base_name = self._agent_name = agent_name
        self._connect_timeout_s = connect_timeout_s
        self._isolated = isolated
        isolated_agent = functools.partial(IsolatedAgent, enable_prog_thread=progress_thread,
                                           call_timeout_s=agent_call_timeout_s, nixl_api_module=nixl_agent.__module__)
        self._new_agent = isolated_agent if isolated else functools.partial(new_inline_agent,
                                                                             progress_thread=progress_thread)
        self._on_agent_restart = on_agent_restart
        # A few bytes of our own to land the warm-up read of `connect` in.
        self._scratch = allocate_host_or_device(view.device, _WARM_UP_BYTES, isolated)
        self._mem_type = "VRAM" if view.is_cuda else "DRAM"
        self._device_id = view.get_device() if view.is_cuda else 0
        self._peers: dict[str, ConnectedPeer] = {}
        self._connecting: dict[str, ConnectedPeer] = {}
        self._connect_failures: dict[str, str] = {}
        self._unreleased: list[Any] = []  # transfers NIXL could not release yet
        self._in_flight: dict[int, ReadInFlight] = {}
        self._handle_ids = itertools.count(1)
        self._closed = False
        self.generation = 0  # how many times the agent was replaced (its name and metadata change each time)
        self._agent: Any = None  # None while a replacement starts
        self._restart = AgentRestart()
        if view.is_cuda:
            allow_cuda_ipc_reads()
        try:
            self._install(*self._first_agent(agent_name))
        except TransferError:
            raise
        except Exception as exc:  # NIXL binding errors share no base class
            raise TransferError(f"cannot set up NIXL agent {agent_name!r}: {exc!r}") from exc
        logger.info("NIXL agent %s registered %d pages of %d bytes (%s%s)", agent_name, self.num_blocks,
                    self.page_bytes, self._mem_type, ", own process" if isolated else "")

    def _first_agent(self, agent_name: str) -> tuple[Any, AgentRegistration]:  # type: ignore[return]
        """A started agent with the pool registered. An agent process whose own random layout took the
        pool's addresses cannot map it there; a fresh process (another layout) tries again."""
        for attempt in range(1, _ADDRESS_ATTEMPTS + 1):
            agent = self._new_agent(agent_name)
            try:
                if isinstance(agent, IsolatedAgent):
                    agent.wait_ready(_AGENT_START_TIMEOUT_S)
                return agent, self._register_with(agent)
            except AddressTaken as exc:
                agent.close()
                if attempt == _ADDRESS_ATTEMPTS:
                    raise
                logger.warning("NIXL agent %s (try %d): %s; starting another process", agent_name, attempt, exc)

    def _register_with(self, agent: Any) -> AgentRegistration:
        """Register the pool and the scratch buffer with `agent` and prepare the page list. Touches
        nothing of `self` but the memory: a replacement agent runs this on a helper thread."""
        if "UCX" not in agent.backends:
            raise TransferError("the NIXL UCX backend plugin is not available")
        pool, scratch = agent.register_memory(self._view), agent.register_memory(self._scratch)
        pages = agent.prep_xfer_dlist(_LOCAL_AGENT, self._descriptors(self.page_bytes), self._mem_type)
        return AgentRegistration(pool, scratch, pages, agent.get_agent_metadata())

    def _install(self, agent: Any, registered: AgentRegistration) -> None:
        """Use `agent`, registered by `_register_with` (engine thread)."""
        self._registration, self._scratch_registration = registered.pool, registered.scratch
        # Local descriptor lists by unit (whole pages, or the chunks a peer's reads move).
        self._local_dlists = {self.page_bytes: registered.pages}
        self._metadata = registered.metadata
        self._agent_name = agent.name  # before the agent: other threads read both
        # No callback holds `self`: a reference cycle would leave the agent to the cyclic garbage
        # collector, whose arbitrary finalization order aborts inside NIXL.
        self._staging = StagingBuffers(functools.partial(allocate_host_or_device, self._view.device,
                                                         shared=self._isolated),
                                       lambda memory: memory.data_ptr(), agent.register_memory,
                                       agent.deregister_memory, max_idle_bytes=self._staging_idle_bytes)
        self._agent = agent

    def _agent_alive(self) -> bool:
        """False while no agent serves: its process just died (what it held is dropped) or the new one starts."""
        death = self._agent.dead if isinstance(self._agent, IsolatedAgent) else None  # an inline agent dies with us
        if self._agent is not None and death is None:
            return True
        if self._agent is not None:
            self._lose_agent(death)
        replacement = self._restart.advance(self._new_agent, f"{self._base_name}-r{self.generation}",
                                            self._register_with)  # registers on a helper thread
        if replacement is None:
            return False
        self._install(*replacement)
        logger.warning("NIXL agent %s is up (replacement %d): peers reconnect to it", self._agent_name, self.generation)
        return True

    def _lose_agent(self, reason: str) -> None:
        logger.error("%s: failing its %d reads in flight, dropping %d peers; starting a new agent", reason,
                     len(self._in_flight), len(self._peers) + len(self._connecting))
        for in_flight in self._in_flight.values():
            in_flight.lost = f"the NIXL agent died during the read: {reason}"
        for key in self._connecting:
            self._connect_failures[key] = f"the NIXL agent died while connecting: {reason}"
        for held in (self._peers, self._connecting, self._unreleased):
            held.clear()
        self._agent = None
        self.generation += 1
        self._restart.begin()
        if self._on_agent_restart is not None:
            self._on_agent_restart()

    @property
    def num_blocks(self) -> int:
        return self._view.shape[0]

    @property
    def page_bytes(self) -> int:
        return self._view.shape[1]

    @property
    def agent_name(self) -> str:
        return self._agent_name

    @property
    def prepared_chunk_bytes(self) -> tuple[int, ...]:
        """Chunk sizes whose local descriptor lists are prepared (whole pages always; fine chunks never)."""
        return tuple(sorted(self._local_dlists))

    @property
    def staging_bytes(self) -> int:  # held, idle or lent to a read
        return self._staging.total_bytes

    def _descriptors(self, chunk_bytes: int) -> np.ndarray:
        return chunk_descriptors(self._view.data_ptr(), num_chunks(self.page_bytes, chunk_bytes, self.num_blocks),
                                 chunk_bytes, self._device_id)

    def _local_dlist(self, chunk_bytes: int) -> Any:
        dlist = self._local_dlists.get(chunk_bytes)
        if dlist is None:
            dlist = self._local_dlists[chunk_bytes] = self._agent.prep_xfer_dlist(
                _LOCAL_AGENT, self._descriptors(chunk_bytes), self._mem_type)
        return dlist

    def local_peer_info(self, engine_id: str, epoch: str) -> PeerInfo:
        if self._agent is None:
            raise TransferError("the NIXL agent is restarting")
        return PeerInfo(engine_id=engine_id, epoch=epoch, agent_name=self._agent_name,
                        agent_metadata=self._metadata, mem_type=self._mem_type, device_id=self._device_id,
                        base_address=self._view.data_ptr(), num_blocks=self.num_blocks, page_bytes=self.page_bytes)

    # ---- peers -----------------------------------------------------------------------

    def begin_connect(self, peer: PeerInfo, chunk_bytes: int | None = None) -> str:
        key = peer.key
        if not self._agent_alive():
            raise TransferError("the NIXL agent is restarting")
        if key in self._peers or key in self._connecting:
            return key
        if chunk_bytes is None and peer.page_bytes != self.page_bytes:
            raise TransferError(f"peer {key} has pages of {peer.page_bytes} bytes, this pool {self.page_bytes}")
        chunk = chunk_bytes or self.page_bytes
        if self.page_bytes % chunk or peer.page_bytes % chunk:
            raise TransferError(f"chunks of {chunk} bytes divide neither pages of {peer.page_bytes} (peer {key}) "
                                f"nor of {self.page_bytes} (here)")
        if peer.agent_name == self._agent_name:
            raise TransferError(f"peer {key} uses this agent's own name {peer.agent_name!r}")
        self._connect_failures.pop(key, None)
        held = {**self._peers, **self._connecting}
        for clash in [k for k, p in held.items() if p.info.clashes_with(peer)]:
            raise TransferError(f"peer {key} announces agent {peer.agent_name!r}, which peer {clash} uses")
        for stale_key in [k for k, p in held.items() if p.info.replaced_by(peer)]:
            logger.info("peer %s replaced by %s (restart)", stale_key, key)
            self.disconnect(stale_key)
        remote_name = self._load_remote(peer)
        dlist = None
        try:
            if max(self.page_bytes, peer.page_bytes) // chunk <= MAX_PREPPED_CHUNKS_PER_PAGE:
                descs = chunk_descriptors(peer.base_address, num_chunks(peer.page_bytes, chunk, peer.num_blocks),
                                          chunk, peer.device_id)
                dlist = self._agent.prep_xfer_dlist(remote_name, descs, peer.mem_type)
                self._local_dlist(chunk)
        except Exception as exc:
            if dlist is not None:
                dlist.release()
            self._forget_remote(remote_name)
            raise TransferError(f"cannot describe the pool of peer {key}: {exc!r}") from exc
        try:
            warm_up = self._start_warm_up(peer, remote_name)
        except TransferError:
            if dlist is not None:
                dlist.release()
            self._forget_remote(remote_name)
            raise
        self._connecting[key] = ConnectedPeer(peer, remote_name, dlist, chunk, warm_up)
        return key

    def poll_connect(self, peer_key: str) -> TransferState:
        if peer_key in self._peers:
            return TransferState.DONE
        pending = self._connecting.get(peer_key)
        if pending is None:
            return TransferState.FAILED
        try:
            status = self._agent.check_xfer_state(pending.warm_up)
        except Exception as exc:
            status = f"ERR ({exc!r})"
        if status == "PROC":
            return TransferState.PENDING
        del self._connecting[peer_key]
        self._release_xfer(pending.warm_up)
        pending.warm_up = None
        if status != "DONE":
            self._connect_failures[peer_key] = f"peer {peer_key} is not reachable: warm-up read ended in {status}"
            self._drop(pending)
            return TransferState.FAILED
        self._peers[peer_key] = pending
        logger.info("connected to peer %s (agent %s, %d pages)", peer_key, pending.remote_name, pending.info.num_blocks)
        return TransferState.DONE

    def connect_failure(self, peer_key: str) -> str | None:
        return self._connect_failures.get(peer_key)

    def connect(self, peer: PeerInfo) -> str:
        return wait_connected(self, peer, self._connect_timeout_s)

    def _load_remote(self, peer: PeerInfo) -> str:
        try:
            loaded = self._agent.add_remote_agent(peer.agent_metadata)
        except Exception as exc:
            raise TransferError(f"NIXL rejected the metadata of peer {peer.key}: {exc!r}") from exc
        # nixl 1.5 returns the name as bytes although documented as str.
        remote_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if remote_name != peer.agent_name:
            self._forget_remote(remote_name)
            raise TransferError(f"peer {peer.key} announced agent {peer.agent_name!r} but its metadata "
                                f"names {remote_name!r}")
        return remote_name

    def _start_warm_up(self, peer: PeerInfo, remote_name: str) -> Any:
        """Start reading a few bytes of the peer's page 0 into our scratch buffer: proves the peer is
        reachable now rather than at the first request, and completes UCX's connection set-up (without
        a progress thread a notification on a half-set-up connection waits for later NIXL calls)."""
        size = min(_WARM_UP_BYTES, peer.page_bytes)
        try:
            local = self._agent.get_xfer_descs([(self._scratch.data_ptr(), size, self._device_id)], self._mem_type)
            remote = self._agent.get_xfer_descs([(peer.base_address, size, peer.device_id)], peer.mem_type)
            xfer = self._agent.initialize_xfer("READ", local, remote, remote_name, b"")
            status = self._agent.transfer(xfer)
        except Exception as exc:
            raise TransferError(f"peer {peer.key} is not reachable: {exc!r}") from exc
        if status not in ("PROC", "DONE"):
            self._release_xfer(xfer)
            raise TransferError(f"peer {peer.key} is not reachable: warm-up read ended in {status}")
        return xfer

    def _release_xfer(self, xfer: Any) -> None:
        """Release a transfer handle; one NIXL cannot cancel yet is retried at the next close."""
        try:
            xfer.release()
        except Exception as exc:
            logger.warning("a NIXL transfer could not be released yet: %r", exc)
            self._unreleased.append(xfer)

    def _forget_remote(self, remote_name: str) -> None:
        try:
            self._agent.remove_remote_agent(remote_name)
        except Exception as exc:
            logger.warning("removing NIXL agent %s failed: %r", remote_name, exc)

    def disconnect(self, peer_key: str) -> None:
        peer = self._peers.pop(peer_key, None) or self._connecting.pop(peer_key, None)
        if peer is None:
            return
        if peer.warm_up is not None:
            self._release_xfer(peer.warm_up)
            peer.warm_up = None
        self._drop(peer)
        logger.info("disconnected from peer %s", peer_key)

    def _drop(self, peer: ConnectedPeer) -> None:
        try:
            if peer.dlist is not None:
                peer.dlist.release()
        except Exception as exc:
            logger.warning("releasing the descriptors of peer %s failed: %r", peer.info.key, exc)
        self._forget_remote(peer.remote_name)

    # ---- reads -----------------------------------------------------------------------

    def start_read(self, peer_key: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notification: bytes) -> TransferHandle:
        peer = self._peers.get(peer_key)
        if peer is None:
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        chunk = peer.chunk_bytes
        local_ids = check_ids("local", local_block_ids, num_chunks(self.page_bytes, chunk, self.num_blocks))
        remote_ids = check_ids("remote", remote_block_ids, num_chunks(peer.info.page_bytes, chunk,
                                                                       peer.info.num_blocks))
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local block ids for {len(remote_ids)} remote ones")
        handle = TransferHandle(next(self._handle_ids), peer_key, 0, len(local_ids) * chunk, time.monotonic())
        if len(local_ids) == 0:
            return self._finish_empty(handle, notification)
        direct, staged = choose_runs(local_ids, remote_ids, chunk, self._read_mode, self._staged_factor,
                                     self._staged_max_descriptor_bytes)
        buffer = None
        if staged is not None:
            try:
                buffer = self._staging.acquire(staged.num_chunks * chunk)
            except Exception as exc:
                if self._read_mode == "staged":
                    return fail_read(handle, f"no staging buffer for the read from peer {peer_key}: {exc!r}")
                logger.warning("no staging buffer (%r): reading directly from peer %s", exc, peer_key)
                staged = None
        scatter = None
        try:
            if staged is not None and buffer is not None:
                handle.num_blocks = len(staged)
                scatter = Scatter(buffer, torch.from_numpy(staged.local_ids_by_remote).to(self._view.device), chunk)
                spec = self._staged_spec(peer, staged, buffer, notification)
            else:
                handle.num_blocks = len(direct)
                spec = self._direct_spec(peer, direct, local_ids, remote_ids, notification)
            read = reads_of(self._agent, self._read_op, IsolatedAgent).start_read(spec, self._read_settle_s)
        except Exception as exc:  # nothing was made (an agent that died is noticed at the next poll)
            if buffer is not None:
                self._staging.give_back(buffer)
            return fail_read(handle, f"cannot create the read from peer {peer_key}: {exc!r}")
        in_flight = self._in_flight[handle.handle_id] = ReadInFlight(read, peer_key, scatter)
        handle.error = read.error or handle.error  # e.g. the peer disconnected after the request was made
        self._apply_status(handle, in_flight, read.status)
        return handle

    def _direct_spec(self, peer: ConnectedPeer, runs: DirectRuns, local_ids: np.ndarray, remote_ids: np.ndarray,
                     notification: bytes) -> ReadSpec:
        """A READ straight into the pool: the prepared lists where nothing merges, else one descriptor per run."""
        chunk = peer.chunk_bytes
        if peer.dlist is not None and len(runs) == len(local_ids):
            return ReadSpec(self._local_dlist(chunk), peer.dlist, peer.remote_name, notification,
                            local_ids.astype(np.int32), remote_ids.astype(np.int32))
        local = run_descriptors(self._view.data_ptr(), runs.local_first, runs.count, chunk, self._device_id)
        remote = run_descriptors(peer.info.base_address, runs.remote_first, runs.count, chunk, peer.info.device_id)
        return ReadSpec(local, remote, peer.remote_name, notification, local_mem=self._mem_type,
                        remote_mem=peer.info.mem_type)

    def _staged_spec(self, peer: ConnectedPeer, runs: StagedRuns, buffer: StagingBuffer,
                     notification: bytes) -> ReadSpec:
        """A READ of one descriptor per remote run into consecutive chunks of the staging buffer."""
        chunk = peer.chunk_bytes
        local = run_descriptors(buffer.address, runs.staging_first, runs.count, chunk, self._device_id)
        remote = run_descriptors(peer.info.base_address, runs.remote_first, runs.count, chunk, peer.info.device_id)
        return ReadSpec(local, remote, peer.remote_name, notification, local_mem=self._mem_type,
                        remote_mem=peer.info.mem_type)

    def _finish_empty(self, handle: TransferHandle, notification: bytes) -> TransferHandle:
        if notification:
            try:
                self.send_message(handle.peer_key, notification)
            except TransferError as exc:
                return fail_read(handle, exc.message)
        handle.state = TransferState.DONE
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        in_flight = self._in_flight.get(handle.handle_id)
        if in_flight is None:
            return fail_read(handle, "the handle was released while pending").state
        if in_flight.lost is None:
            self._agent_alive()  # notices a death, which marks this read lost
        if in_flight.lost is not None:
            return fail_read(handle, in_flight.lost).state
        if in_flight.scatter is not None and in_flight.scatter.copied:
            status = "DONE"  # NIXL finished earlier: only the copy out of staging is left to complete
        else:
            try:
                status = reads_of(self._agent, self._read_op, IsolatedAgent).check_read(in_flight.xfer)
            except Exception as exc:
                status, handle.error = "ERR", repr(exc)
        self._apply_status(handle, in_flight, status)
        return handle.state

    def _apply_status(self, handle: TransferHandle, in_flight: ReadInFlight, status: str) -> None:
        if status == "DONE":
            if in_flight.scatter is None:
                handle.state = TransferState.DONE
            else:
                self._finish_staged(handle, in_flight.scatter)
        elif status != "PROC":
            fail_read(handle, handle.error or f"NIXL reported {status} for the read from peer {handle.peer_key}")

    def _finish_staged(self, handle: TransferHandle, scatter: Scatter) -> None:
        """Copy the staged chunks into the pool (once); DONE when that copy has completed."""
        if not scatter.copied:
            try:
                copy_out_of_staging(self._view, scatter)
            except Exception as exc:
                fail_read(handle, f"copying the staged chunks into the pool failed: {exc!r}")
                return
        if scatter.fence is None or scatter.fence.query():
            handle.state = TransferState.DONE

    def release(self, handle: TransferHandle) -> bool:
        in_flight = self._in_flight.get(handle.handle_id)
        if in_flight is None:
            return True
        if in_flight.lost is not None:  # its agent process is gone: nothing writes the pages any more
            del self._in_flight[handle.handle_id]
            fail_read(handle, in_flight.lost)
            return True
        scatter = in_flight.scatter
        if scatter is not None and scatter.fence is not None and not scatter.fence.query():
            return False  # the copy into the pool is still running on the GPU
        try:
            in_flight.xfer.release()
        except Exception as exc:
            # NIXL refuses to free a transfer it cannot cancel: its pages (and staging buffer) stay busy.
            logger.warning("read %d from peer %s could not be released yet: %r",
                           handle.handle_id, handle.peer_key, exc)
            return False
        del self._in_flight[handle.handle_id]
        if scatter is not None:
            self._staging.give_back(scatter.buffer, scatter.fence)
        if handle.state is TransferState.PENDING:
            fail_read(handle, "cancelled by release")
        return True

    # ---- notifications ---------------------------------------------------------------

    def poll_notifications(self) -> list[bytes]:
        if not self._agent_alive():
            return []
        try:
            by_agent = self._agent.get_new_notifs()
        except Exception as exc:
            logger.warning("fetching NIXL notifications failed: %r", exc)
            self._agent_alive()  # an agent process that died is replaced now
            return []
        return [message for messages in by_agent.values() for message in messages]

    def send_message(self, peer_key: str, payload: bytes) -> None:
        peer = self._peers.get(peer_key)
        if peer is None:
            raise TransferError(f"unknown peer {peer_key!r}: connect first")
        try:
            self._agent.send_notif(peer.remote_name, payload)
        except Exception as exc:
            raise TransferError(f"cannot notify peer {peer_key}: {exc!r}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._restart.close()
        if self._agent is None or (isinstance(self._agent, IsolatedAgent) and self._agent.dead is not None):
            return  # its process died and took everything it held with it
        # One progress call first: without it, destroying the agent after a read from a killed peer
        # aborted the process now and then (UCX had not yet handled the lost endpoint).
        self.poll_notifications()
        for handle_id, in_flight in list(self._in_flight.items()):
            try:
                in_flight.xfer.release()
            except Exception as exc:
                logger.warning("read %d still active at close: %r", handle_id, exc)
        self._in_flight.clear()
        for peer_key in [*self._peers, *self._connecting]:
            self.disconnect(peer_key)
        for xfer in self._unreleased:
            try:
                xfer.release()
            except Exception as exc:
                logger.warning("a NIXL transfer still active at close: %r", exc)
        self._unreleased.clear()
        self._staging.close()
        try:
            for dlist in self._local_dlists.values():
                dlist.release()
            self._agent.deregister_memory(self._registration)
            self._agent.deregister_memory(self._scratch_registration)
        except Exception as exc:
            logger.warning("unregistering the pool of agent %s failed: %r", self._agent_name, exc)
        if isinstance(self._agent, IsolatedAgent):
            self._agent.close()


def new_inline_agent(name: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend in this process (an agent process makes its own with this)."""
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
