"""Builds the P or D side of a worker: transport, handshake identity, role hooks, front end.

Invariant: one transport per worker, registered over the whole pool's
canonical view, created on the thread that will drive it (the engine loop's
owner) before any request arrives.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from typing import Union

from pdserve.config import WorkerConfig
from pdserve.engine.decode_role import DecodeRole
from pdserve.engine.kv_frontend import DecodeFrontend, PrefillFrontend
from pdserve.engine.prefill_role import PrefillIdentity, PrefillRole
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import KVGroupPlan
from pdserve.metrics import Metrics
from pdserve.models.base import ModelSpec
from pdserve.transfer.handshake import PROTOCOL_VERSION, AgentInfo, HandshakeClient, PoolGeometry, compatibility_hash, groups_to_wire
from pdserve.transfer.leases import LeaseTable


@dataclass
class KVRoleParts:
    role: Union[PrefillRole, DecodeRole]
    frontend: Union[PrefillFrontend, DecodeFrontend]
    agent_info: AgentInfo
    transport: object


def _fingerprint(model_name: str, spec: ModelSpec) -> str:
    return f"{model_name}|{spec.architecture}|{spec.num_layers}|{spec.hidden_size}|{spec.vocab_size}"


def build_kv_role(config: WorkerConfig, metrics: Metrics, kv: KVCacheManager, plan: KVGroupPlan,
                  layout: KVPoolLayout, pool, spec: ModelSpec, model_name: str, dtype_name: str) -> KVRoleParts:
    from pdserve.transfer.nixl_transport import NixlTransport  # the one module that imports nixl

    transfer = config.transfer
    host = transfer.advertise_host or config.server.host
    engine_id = transfer.engine_id or f"{config.role}-{socket.gethostname()}-{config.server.port}"
    epoch = uuid.uuid4().hex[:16]
    transport = NixlTransport(layout.canonical_view(pool), agent_name=f"{engine_id}-{epoch}")
    own_hash = compatibility_hash(_fingerprint(model_name, spec), dtype_name, spec.num_kv_heads, spec.head_dim,
                                  layout.block_size, plan)
    agent_info = AgentInfo(
        protocol_version=PROTOCOL_VERSION, compat_hash=own_hash, engine_id=engine_id, epoch=epoch,
        geometry=PoolGeometry(num_blocks=layout.num_blocks, page_bytes=layout.page_bytes, block_size=layout.block_size,
                              group_size=plan.group_size, groups=groups_to_wire(plan)),
        transport=transport.local_peer_info(engine_id, epoch).to_dict(),
    )
    if config.role == "prefill":
        identity = PrefillIdentity(engine_id, epoch, host, config.server.port)
        role = PrefillRole(kv, transport, LeaseTable(transfer.lease_s), identity, metrics.transfer)
        return KVRoleParts(role, PrefillFrontend(), agent_info, transport)
    handshake = HandshakeClient(own_hash, config.server.internal_token, transfer.handshake_timeout_s,
                                on_handshake=metrics.transfer.handshakes.inc)
    role = DecodeRole(kv, transport, metrics.transfer, transfer.failure_policy, transfer.pull_timeout_s, transfer.heartbeat_s)
    return KVRoleParts(role, DecodeFrontend(handshake, plan, layout.block_size, transfer.failure_policy), agent_info, transport)
