"""Builds a worker's P/D side from its config: transport, identity, connector, admission.

Invariant: one transport per P or D worker, registered over the whole pool's
canonical view before any request arrives; a colocated worker gets no
transport and a connector that frees everything at finish. The transport is
made by an injected factory (NIXL by default; the in-process fake in tests).
"""

from __future__ import annotations

import functools
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import httpx

from pdserve.api.config import WorkerConfig, is_loopback_host
from pdserve.api.kv_transfer import PROTOCOL_VERSION, AgentInfo, PoolGeometry
from pdserve.kv.specs import KVGroupPlan
from pdserve.metrics import Metrics
from pdserve.pd.admission import DecodeAdmission, KVAdmission, LocalAdmission, PrefillAdmission, engine_thread_connector
from pdserve.pd.connector import KVConnector, NoConnector
from pdserve.pd.decode import DecodeConnector
from pdserve.pd.handshake import HandshakeClient, groups_to_wire
from pdserve.pd.leases import LeaseTable
from pdserve.pd.lending import LenderIdentity, PinLender, transfer_epoch
from pdserve.pd.peer_admission import PeerPinClient, PeerPullAdmission
from pdserve.pd.peer_costs import PeerPullCosts
from pdserve.pd.peer_pins import peer_pull_problem
from pdserve.pd.peer_pull import PeerPullConnector
from pdserve.pd.peer_trust import PeerAllowList
from pdserve.pd.peers import PeerConnections
from pdserve.pd.prefill import PrefillConnector
from pdserve.pd.ticket_inbox import TicketInbox
from pdserve.pd.tickets import TicketAdmission, TicketClient
from pdserve.transfer.transport import KVTransport, TransferError

# (pool's canonical int8 view [num_blocks, page_bytes], agent name) -> transport
TransportFactory = Callable[[Any, str], KVTransport]


def nixl_transport(pool_view: Any, agent_name: str, isolated: bool = False,
                   on_agent_restart: Optional[Callable[[], None]] = None) -> KVTransport:
    from pdserve.transfer.nixl_transport import NixlTransport  # the one module that imports nixl

    return NixlTransport(pool_view, agent_name=agent_name, isolated=isolated, on_agent_restart=on_agent_restart)


def configured_transport(factory: TransportFactory, isolated: bool, metrics: Metrics) -> TransportFactory:
    """The NIXL factory with this worker's agent isolation and restart metric; another factory (the
    in-process fake of tests) as it is."""
    if factory is not nixl_transport:
        return factory
    return functools.partial(nixl_transport, isolated=isolated, on_agent_restart=metrics.transfer.agent_restarts.inc)


@dataclass(frozen=True, slots=True)
class PoolDescription:
    """What the P/D side needs to know of the pool it moves pages of."""

    plan: KVGroupPlan
    num_blocks: int
    block_size: int
    page_bytes: int
    compat_hash: str  # see pdserve/pd/handshake.py: equal on both sides or no sharing
    compatibility: dict = field(default_factory=dict)  # what the hash covers, named (refusals say what differs)


@dataclass
class KVSide:
    connector: KVConnector
    transport: Optional[KVTransport] = None
    describe: Optional[Callable[[str], AgentInfo]] = None  # transfer epoch -> the handshake's answer
    peers: Optional[PeerConnections] = None  # decode workers, and P with peer pulls on
    base_epoch: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    peer_pull: Optional[PeerPullConnector] = None  # peer pulls on: wraps `connector` for the scheduler
    count_peer_pinned: Callable[[str, int], None] = lambda medium, num_tokens: None  # tokens lent, by medium
    ticket_inbox: Optional[TicketInbox] = None  # D: P's params for decode legs sent before P answered
    lender: Optional[PinLender] = None  # the lease table of what others read here: P's connector; D's with peer pulls

    @property
    def engine_connector(self) -> KVConnector:
        """What the scheduler talks to: the peer-pull wrapper when there is one, else the connector."""
        return self.peer_pull if self.peer_pull is not None else self.connector

    @property
    def agent_info(self) -> Optional[AgentInfo]:
        """The handshake's answer now (it names the current agent); None while the agent restarts."""
        if self.describe is None:
            return None
        try:
            generation = self.transport.generation if self.transport is not None else 0
            return self.describe(transfer_epoch(self.base_epoch, generation))
        except TransferError:
            return None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def build_kv_side(config: WorkerConfig, metrics: Metrics, pool: PoolDescription, pool_view: Any,
                  transport_factory: TransportFactory = nixl_transport) -> KVSide:
    """The connector (and, for P and D, the transport and handshake identity) of a worker."""
    if config.role == "colocated":
        return KVSide(NoConnector())
    transfer = config.transfer
    engine_id = transfer.engine_id or f"{config.role}-{socket.gethostname()}-{config.server.port}"
    epoch = uuid.uuid4().hex[:16]
    transport = transport_factory(pool_view, f"{engine_id}-{epoch}")

    def describe(current_epoch: str) -> AgentInfo:
        return AgentInfo(
            protocol_version=PROTOCOL_VERSION, compat_hash=pool.compat_hash, engine_id=engine_id,
            epoch=current_epoch, geometry=PoolGeometry(
                num_blocks=pool.num_blocks, page_bytes=pool.page_bytes, block_size=pool.block_size,
                group_size=pool.plan.group_size, groups=groups_to_wire(pool.plan)),
            transport=transport.local_peer_info(engine_id, current_epoch).to_dict(),
            tp_size=config.parallel.tensor_parallel_size, compatibility=pool.compatibility,
        )
    identity = LenderIdentity(engine_id, epoch, transfer.advertise_host or config.server.host,
                              config.server.internal_listen_port, config.parallel.tensor_parallel_size)
    leases = LeaseTable(transfer.lease_s, max_pin_s=transfer.pin_lifetime_s)
    max_pinned = int(transfer.max_pinned_share * (pool.num_blocks - 1))  # block 0 is the null block

    def count_peer_pinned(medium: str, num_tokens: int) -> None:  # tokens lent to peers, by where they were
        metrics.kv.peer_pinned_tokens.labels(medium).inc(num_tokens)

    if config.role == "prefill":
        connector = PrefillConnector(transport, leases, identity, pool.plan, pool.block_size, metrics.transfer,
                                     max_pinned_blocks=max_pinned)
        peers = PeerConnections(transport, transfer.connect_timeout_s) if peer_pulls(config, pool) else None
        return KVSide(connector, transport, describe, peers, base_epoch=epoch,
                      peer_pull=_peer_pull(config, metrics, pool, connector, transport, peers, poll_peers=True),
                      count_peer_pinned=count_peer_pinned, lender=connector)
    peers = PeerConnections(transport, transfer.connect_timeout_s)
    # With peer pulls on, D lends its prefixes (answers included) to peers, under a lease table of its own.
    lender = (PinLender(transport, leases, identity, metrics.transfer, max_pinned_blocks=max_pinned)
              if peer_pulls(config, pool) else None)
    connector = DecodeConnector(transport, peers, pool.plan, pool.block_size, metrics.transfer,
                                transfer.failure_policy, transfer.pull_timeout_s, transfer.heartbeat_s,
                                lease_s=transfer.lease_s, tp_size=config.parallel.tensor_parallel_size, lender=lender)
    return KVSide(connector, transport, describe, peers, base_epoch=epoch,
                  peer_pull=_peer_pull(config, metrics, pool, connector, transport, peers, poll_peers=False),
                  count_peer_pinned=count_peer_pinned, ticket_inbox=TicketInbox(transfer.ticket_wait_s), lender=lender)


def peer_pulls(config: WorkerConfig, pool: PoolDescription) -> bool:
    """Whether this worker pulls prefixes from peers and pins its own for peers (P and D alike): on, and a
    model whose KV moves between peers (pd/peer_pins.py)."""
    return config.role != "colocated" and config.transfer.peer_pull and peer_pull_problem(pool.plan) is None


def _peer_pull(config: WorkerConfig, metrics: Metrics, pool: PoolDescription, connector: KVConnector,
               transport: KVTransport, peers: Optional[PeerConnections], poll_peers: bool) -> Optional[PeerPullConnector]:
    if peers is None or not peer_pulls(config, pool):
        return None
    transfer = config.transfer
    costs = PeerPullCosts(transfer.peer_pull_min_tokens, measured=transfer.peer_pull_decision == "measured")
    metrics.kv.watch_peer_pull_costs(lambda: costs.compute_s_per_token, lambda: costs.pull_s_per_token,
                                     lambda: costs.pin_s)
    return PeerPullConnector(connector, transport, peers, pool.plan, pool.block_size,
                             count_tokens=metrics.kv.count_peer_pull, observe_pull_s=metrics.kv.peer_pull_s.observe,
                             pull_timeout_s=transfer.pull_timeout_s, lease_s=transfer.lease_s,
                             tp_size=config.parallel.tensor_parallel_size, poll_peers=poll_peers, costs=costs)


def _peer_admission(config: WorkerConfig, metrics: Metrics, pool: PoolDescription, side: KVSide, inner: KVAdmission,
                    run_on_engine_thread: Callable[[Callable[[], None]], None],
                    http_transport: Optional[httpx.AsyncBaseTransport]) -> KVAdmission:
    """`inner` with peer pulls in front when this worker pulls from peers."""
    if side.peer_pull is None or side.peers is None:
        return inner
    transfer, token = config.transfer, config.server.internal_token
    handshake = HandshakeClient(pool.compat_hash, token, transfer.handshake_timeout_s,
                                own_compatibility=pool.compatibility,
                                on_handshake=metrics.transfer.handshakes.inc, http_transport=http_transport)
    connect = engine_thread_connector(run_on_engine_thread, side.peers.ensure, transfer.connect_timeout_s + 1.0)
    return PeerPullAdmission(inner, PeerPinClient(token, transfer.handshake_timeout_s, http_transport),
                             TicketClient(token, transfer.handshake_timeout_s, http_transport), handshake, connect,
                             pool.plan, pool.block_size, config.parallel.tensor_parallel_size,
                             transfer.peer_pull_min_tokens, metrics.kv.count_peer_pull,
                             PeerAllowList.parse(transfer.allowed_peers),
                             vouched=token is not None or is_loopback_host(config.server.host),
                             costs=side.peer_pull.costs)


def _counted_room_check(connector: PrefillConnector, metrics: Metrics) -> Callable[[int], bool]:
    """The prefill admission's question, with refusals counted."""

    def has_room_to_pin(num_blocks: int) -> bool:
        if connector.has_room_to_pin(num_blocks):
            return True
        metrics.transfer.pinned_refusals.inc()
        return False

    return has_room_to_pin


def build_admission(config: WorkerConfig, metrics: Metrics, pool: PoolDescription, side: KVSide,
                    run_on_engine_thread: Callable[[Callable[[], None]], None],
                    http_transport: Optional[httpx.AsyncBaseTransport] = None) -> KVAdmission:
    """The async-side checks of a worker's kv_transfer_params (needs the engine loop to connect peers)."""
    if config.role == "colocated":
        return LocalAdmission()
    if config.role == "prefill":
        prefill = PrefillAdmission(pool.plan, pool.block_size, _counted_room_check(cast(PrefillConnector, side.connector),
                                                                                  metrics))
        return _peer_admission(config, metrics, pool, side, prefill, run_on_engine_thread, http_transport)
    transfer = config.transfer
    handshake = HandshakeClient(pool.compat_hash, config.server.internal_token, transfer.handshake_timeout_s,
                                own_compatibility=pool.compatibility,
                                on_handshake=metrics.transfer.handshakes.inc, http_transport=http_transport)
    # The engine thread abandons a connection after connect_timeout_s; wait a little longer for its word.
    connect = engine_thread_connector(run_on_engine_thread, side.peers.ensure, transfer.connect_timeout_s + 1.0)
    failures = metrics.transfer.failures.labels(policy=transfer.failure_policy)
    allowed_peers = PeerAllowList.parse(transfer.allowed_peers)
    inner = DecodeAdmission(handshake, pool.plan, pool.block_size, transfer.failure_policy, connect,
                            count_failure=failures.inc, allowed_peers=allowed_peers,
                            tp_size=config.parallel.tensor_parallel_size)
    tickets = TicketClient(config.server.internal_token, transfer.handshake_timeout_s, http_transport)
    recomputed = metrics.transfer.recomputed_prompt_tokens
    first_token_recomputed = metrics.transfer.first_token_recomputed
    tickets_first = TicketAdmission(
        inner, tickets, transfer.failure_policy, allowed_peers=allowed_peers, failures=inner.failures,
        count_recompute=lambda reason, num_tokens: recomputed.labels(reason=reason).inc(num_tokens),
        count_failure=failures.inc, takes_first_token=not pool.plan.state_group_ids,
        count_first_token_recompute=lambda reason: first_token_recomputed.labels(reason=reason).inc(),
        observe_ticket_s=lambda seconds: metrics.transfer.observe_handoff({"d_ticket": seconds}),
        inbox=side.ticket_inbox)
    return _peer_admission(config, metrics, pool, side, tickets_first, run_on_engine_thread, http_transport)
