"""Assembles a worker's engine from its config: the model side, the KV side and the P/D side
(`model_side`, `kv_cache_side`, `pd_side`), then the scheduler, the loop and its async face.

Invariant: every part is given what it needs at construction (the loop's inbox is made first, so the
offload tier and the P/D admission are built with its wake-up and `call_soon`); nothing is set on an
object after it was built.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Awaitable, Optional

import httpx
import torch

from pdserve.api.config import WorkerConfig
from pdserve.api.kv_transfer import AgentInfo, PinTicket
from pdserve.api.peer_pull import PeerPinRefused, PeerPinTicket
from pdserve.app.kv_cache_side import build_kv_cache_side
from pdserve.app.model_side import ModelSide, build_model_side
from pdserve.app.pd_side import build_pd_side
from pdserve.app.ranks import LocalRanks
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.core_share import CoreShare, open_core_share
from pdserve.engine.emitter import OutputEmitter
from pdserve.engine.inbox import EngineInbox
from pdserve.engine.loop import EngineLoop
from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stats import EngineStats
from pdserve.kv.events import KVEventRecorder
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import KVGroupPlan
from pdserve.metrics import Metrics
from pdserve.models.loader import LoadedModel
from pdserve.pd.leases import Claim
from pdserve.pd.peer_pins import await_peer_pin, peer_pull_problem, pin_peer_prefix, settle_peer_pin
from pdserve.pd.prefill import PrefillConnector
from pdserve.pd.ticket_inbox import Delivery
from pdserve.pd.wiring import KVSide, TransportFactory, nixl_transport
from pdserve.runner.model_runner import ModelRunner
from pdserve.server.kv_events import run_on_engine_thread


logger = logging.getLogger(__name__)
CHECK_INVARIANTS_ENV = "PDSERVE_CHECK_INVARIANTS"  # "1": the loop checks the scheduler's invariants after every step


@dataclass
class BuiltEngine:
    engine: AsyncEngine
    loaded: LoadedModel
    plan: KVGroupPlan
    layout: KVPoolLayout
    kv_manager: KVCacheManager
    runner: ModelRunner
    kv_side: KVSide
    kv_events: KVEventRecorder
    epoch: str  # fresh at every start: the P/D handshake's epoch, or its own for a colocated worker

    @property
    def agent_info(self) -> Optional[AgentInfo]:
        return self.kv_side.agent_info

    def release_pinned(self, request_id: str, nonce: str) -> None:
        """Workers that lend (P; D with peer pulls on): free a pin's blocks now (on the engine thread, at
        its next turn), if `nonce` is its pin's."""
        lender = self.kv_side.lender
        if lender is not None:
            self.engine.engine_loop.call_soon(functools.partial(lender.release_early, request_id, nonce))

    def claim_ticket(self, request_id: str, nonce: str) -> Optional[Claim[PinTicket]]:
        """Prefill workers: a pin's ticket for the reader that shows its nonce (thread-safe; None elsewhere)."""
        connector = self.kv_side.connector
        return connector.claim_ticket(request_id, nonce) if isinstance(connector, PrefillConnector) else None

    def pin_peer_prefix(self, token_ids: list[int]) -> Optional[Awaitable[Optional[PeerPinTicket]]]:
        """P and D workers with peer pulls on: pin, on the engine thread, the longest prefix of `token_ids`
        this pool or its offload tier holds for a peer to read (a decode worker's prefixes include the
        answers it decoded), answered once tier pages landed (pd/peer_pins.py; PeerPinRefused, 409, where
        this worker lends none)."""
        lender = self.kv_side.lender
        if self.kv_side.peer_pull is None or lender is None:
            raise PeerPinRefused(peer_pull_problem(self.plan) or "this worker lends no prefixes to peers")
        count = self.kv_side.count_peer_pinned
        return await_peer_pin(
            functools.partial(run_on_engine_thread, self.engine.engine_loop.call_soon),
            functools.partial(pin_peer_prefix, self.kv_manager, lender, token_ids, count),
            lambda pin, give_up: settle_peer_pin(self.kv_manager, lender, pin, give_up, count))

    def deliver_ticket(self, key: str, params: Optional[dict]) -> Optional[Delivery]:
        """Decode workers: P's params (None: called off) for the decode leg waiting under `key` (the
        worker's event loop; None elsewhere)."""
        inbox = self.kv_side.ticket_inbox
        return inbox.deliver(key, params) if inbox is not None else None

    def close(self) -> None:
        """Stop the engine thread, then release the transport, the offload tier and the other ranks
        (never the other way round)."""
        self.engine.shutdown()
        self.kv_side.close()
        if self.kv_manager.offload is not None:
            self.kv_manager.offload.close()
        self.runner.close()


def _core_share(config: WorkerConfig, metrics: Metrics) -> Optional[CoreShare]:
    """--core-ledger: this worker's threads follow the other worker's work (P and D on one host)."""
    if config.model.core_ledger is None:
        return None
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--core-ledger is for single-rank workers (-tp 1)")
    narrow = config.model.num_threads or torch.get_num_threads()
    wide = config.model.num_threads_alone or len(os.sched_getaffinity(0))

    def set_threads(num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        metrics.engine.cpu_threads.set(num_threads)

    return open_core_share(config.model.core_ledger, config.role, narrow, max(narrow, wide), set_threads)


def _log_ready(config: WorkerConfig, model: ModelSide, model_name: str) -> None:
    plan, layout = model.plan, model.layout
    logger.info(
        "engine ready: role=%s model=%s device=%s dtype=%s kv_dtype=%s tp=%d groups=%d group_size=%d blocks=%d "
        "block_size=%d page_bytes=%d max_model_len=%d", config.role, model_name, model.device, model.dtype,
        model.kv_dtype, config.parallel.tensor_parallel_size, len(plan.groups), plan.group_size, layout.num_blocks,
        layout.block_size, layout.page_bytes, model.max_model_len,
    )


def build_engine(config: WorkerConfig, metrics: Metrics, loaded: LoadedModel | None = None, *,
                 request_ids: Optional[RequestIdRegistry] = None,
                 transport_factory: TransportFactory = nixl_transport,
                 http_transport: Optional[httpx.AsyncBaseTransport] = None,
                 local_ranks: Optional[LocalRanks] = None) -> BuiltEngine:
    """`local_ranks`: the other ranks of a tensor-parallel worker that rank 0 started on this host (app.ranks).
    `loaded` lets tests and benchmarks share one set of weights between engines;
    it must have been loaded with the device and dtype `config` implies. The
    transport factory and the handshake's HTTP transport let in-process tests
    replace NIXL and the network."""
    model = build_model_side(config, loaded, local_ranks)
    inbox = EngineInbox()  # before the parts that report to the loop
    cache = build_kv_cache_side(config, model.plan, model.layout, model.runner.pool, model.channel, inbox.wake)
    model_name = config.model.served_name or model.loaded.name
    pd = build_pd_side(config, metrics, model, model_name, transport_factory, inbox.call_soon, http_transport)
    stats = EngineStats(metrics, cache.kv_manager)
    if pd.kv_side.peer_pull is not None:  # the peer-pull decision prices computing by this worker's own steps
        stats.observe_prefill = pd.kv_side.peer_pull.costs.observe_prefill
    scheduler = Scheduler(config.scheduler, cache.kv_manager, config.cache.block_size, model.max_model_len,
                          connector=pd.kv_side.engine_connector, on_preempt=stats.record_preemption)
    metrics.engine.cpu_threads.set(torch.get_num_threads())
    tokenizer = model.loaded.tokenizer
    loop = EngineLoop(scheduler, model.runner, OutputEmitter(OutputProcessor(tokenizer)), tokenizer.eos_token_ids,
                      stats, request_ids, inbox=inbox, core_share=_core_share(config, metrics),
                      check_invariants=os.environ.get(CHECK_INVARIANTS_ENV) == "1")
    metrics.engine.watch_progress(loop.progress_age_s)
    metrics.engine.watch_ranks(config.parallel.tensor_parallel_size, loop.is_alive)
    max_in_flight = config.scheduler.max_num_running + config.scheduler.max_num_waiting
    reserves = pd.kv_side.ticket_inbox is not None and config.transfer.reserve_before_ticket
    engine = AsyncEngine(loop, model_name, model.max_model_len, tokenizer, max_in_flight, pd.admission,
                         model.grammar_tokenizer, reserves_before_ticket=reserves)
    _log_ready(config, model, model_name)
    return BuiltEngine(engine, model.loaded, model.plan, model.layout, cache.kv_manager, model.runner, pd.kv_side,
                       cache.kv_events, pd.kv_side.base_epoch)
