"""A prefill and a decode worker's P/D sides in one process: real KV managers, schedulers and
connectors, with the fake transport (in-process page copies) standing in for NIXL."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from pdserve.api.config import SchedulerConfig
from pdserve.api.kv_transfer import PROTOCOL_VERSION, AgentInfo, PoolGeometry, RemotePrefillParams
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, KVGroupPlan, SlidingWindowSpec, plan_groups
from pdserve.metrics import Metrics
from pdserve.pd.decode import DecodeConnector
from pdserve.pd.handshake import groups_to_wire
from pdserve.pd.leases import LeaseTable
from pdserve.pd.peers import PeerConnections
from pdserve.pd.prefill import PrefillConnector, PrefillIdentity
from pdserve.request import GenerationRequest, RemoteSource, Request
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.ranked_transport import RankedTransport, encode_ranks, rank_descriptor
from pdserve.transfer.state_ranges import state_splits
from pdserve.transfer.transport import KVTransport
from tests.engine.checked_scheduler import CheckedScheduler

BLOCK = 4
NUM_BLOCKS = 64
PAGE_BYTES = 32
PLAN = plan_groups([FullAttentionSpec(), SlidingWindowSpec(8), FullAttentionSpec(), SlidingWindowSpec(8)])


class FakeClock:
    def __init__(self, now_s: float = 1000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class PrefillSide:
    def __init__(self, fabric: FakeFabric, clock: FakeClock, name: str = "P", lease_s: float = 30.0,
                 plan: KVGroupPlan = PLAN, max_pinned_blocks: Optional[int] = None, prefix_caching: bool = True,
                 block_size: int = BLOCK, page_bytes: int = PAGE_BYTES):
        self.plan = plan
        self.block_size = block_size
        self.kv = KVCacheManager(plan, NUM_BLOCKS, block_size, enable_prefix_caching=prefix_caching)
        self.pool = torch.zeros(NUM_BLOCKS, page_bytes, dtype=torch.int8)
        self.transport = FakeTransport(self.pool, name, fabric)
        self.metrics = Metrics()
        self.name = name
        self.connector = PrefillConnector(self.transport, LeaseTable(lease_s, clock=clock),
                                          PrefillIdentity(name, "epoch-1", "127.0.0.1", 1), plan, block_size,
                                          self.metrics.transfer, max_pinned_blocks)
        self.scheduler = CheckedScheduler(SchedulerConfig(), self.kv, block_size, 10_000, connector=self.connector)

    def prefill(self, request_id: str, num_prompt: int) -> RemotePrefillParams:
        """Run a remote-decode prefill (no model: the test writes a recognisable pattern per page)."""
        request = make_request(request_id, num_prompt, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
        self.scheduler.add_request(request)
        step = self.scheduler.schedule()
        for table in step.chunks[0].block_ids:
            for block_id in table:
                if block_id:
                    self.pool[block_id] = block_id
        self.scheduler.update(step, [SampledToken(request_id, 5, 0.0)])
        assert request.finish_reason is FinishReason.LENGTH
        return request.kv_transfer_params

    def tick(self) -> None:
        self.scheduler.apply_kv_events(self.connector.poll())

    def agent_info(self) -> AgentInfo:
        peer = self.transport.local_peer_info(self.name, "epoch-1")
        ranked = dataclasses.replace(peer, agent_metadata=encode_ranks([rank_descriptor(peer)]))  # as workers send it
        return AgentInfo(
            protocol_version=PROTOCOL_VERSION, compat_hash="h", engine_id=self.name, epoch="epoch-1",
            geometry=PoolGeometry(num_blocks=NUM_BLOCKS, page_bytes=self.transport.page_bytes,
                                  block_size=self.block_size,
                                  group_size=self.plan.group_size, groups=groups_to_wire(self.plan)),
            transport=ranked.to_dict(),
        )


class DecodeSide:
    """With `block_size` other than the prefill side's, the connector reads through the rank reader
    (one rank) in units of the smaller block, as every worker's does; otherwise page by page.
    `kv_page_bytes` (the attention page, when pages are padded for state) makes the reader cut its
    chunks by the pool's geometry, state slots included, as workers' readers do."""

    def __init__(self, fabric: FakeFabric, clock: FakeClock, policy: str = "recompute", max_running: int = 64,
                 pull_timeout_s: float = 60.0, heartbeat_s: float = 5.0, block_size: int = BLOCK,
                 plan: KVGroupPlan = PLAN, page_bytes: int = 0, kv_page_bytes: int = 0,
                 prefill_block_size: int = BLOCK):
        self.plan = plan
        self.block_size = block_size
        self.kv = KVCacheManager(plan, NUM_BLOCKS, block_size)
        self.pool = torch.zeros(NUM_BLOCKS, page_bytes or PAGE_BYTES * block_size // BLOCK, dtype=torch.int8)
        self.transport = FakeTransport(self.pool, "D", fabric)
        self.metrics = Metrics()
        reader: KVTransport = self.transport
        if kv_page_bytes:
            reader = RankedTransport(self.transport, None, [], num_kv_heads=1, num_layer_slots=plan.group_size,
                                     block_size=block_size, kv_page_bytes=kv_page_bytes,
                                     state_splits=state_splits(plan, 1))
        elif block_size != prefill_block_size:
            reader = RankedTransport(self.transport, None, [], num_kv_heads=1, num_layer_slots=PLAN.group_size)
        self.peers = PeerConnections(reader, connect_timeout_s=5.0, clock=clock)
        self.connector = DecodeConnector(reader, self.peers, plan, block_size, self.metrics.transfer, policy,
                                         pull_timeout_s=pull_timeout_s, heartbeat_s=heartbeat_s, clock=clock)
        self.scheduler = CheckedScheduler(SchedulerConfig(max_num_running=max_running), self.kv, block_size, 10_000,
                                   connector=self.connector)

    def connect(self, p: PrefillSide) -> Optional[str]:
        outcome: list[Optional[str]] = []
        from pdserve.transfer.transport import PeerInfo

        via = "127.0.0.1:1"  # P's handshake address, as admission names it
        peer = dataclasses.replace(PeerInfo.from_dict(p.agent_info().transport, via=via), block_size=p.block_size)
        self.peers.ensure(peer, outcome.append)
        self.peers.poll()
        return outcome[0]

    def submit(self, request_id: str, num_prompt: int, source: RemoteSource) -> Request:
        request = make_request(request_id, num_prompt, remote=source)
        self.scheduler.add_request(request)
        return request

    def tick(self) -> None:
        self.scheduler.apply_kv_events(self.connector.poll())


def make_request(request_id: str, num_prompt: int, sampling: Optional[SamplingParams] = None, **fields) -> Request:
    prompt = list(range(10, 10 + num_prompt))
    return Request(request_id, prompt, sampling or SamplingParams(max_tokens=4, temperature=0), (0,), 0.0, **fields)


def source_for(p: PrefillSide, params: RemotePrefillParams, received_s: float) -> RemoteSource:
    return RemoteSource(params, p.agent_info(), received_s)


class InnerAdmission:
    """Stands in for DecodeAdmission (handshake, geometry, connection): records what it was given."""

    def __init__(self):
        self.seen: list[GenerationRequest] = []

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        self.seen.append(request)
        return dataclasses.replace(request, kv_params=None, remote=object())
