"""The P/D side of a worker's engine: what its pool looks like to peers, its transport (rank 0's over
every rank's slice), the connector the scheduler calls and the async-side admission.

Invariant: two workers share KV only when their compatibility hashes are equal: the model, its KV
heads and recurrent state (the model's, not a rank's share), dtype, KV element type and group plan,
whatever their TP sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import httpx

from pdserve.api.config import WorkerConfig
from pdserve.metrics import Metrics
from pdserve.models.base import ModelSpec
from pdserve.app.model_side import ModelSide
from pdserve.pd.admission import KVAdmission
from pdserve.pd.handshake import compatibility_document, compatibility_hash
from pdserve.pd.wiring import (
    KVSide, PoolDescription, TransportFactory, build_admission, build_kv_side, configured_transport)
from pdserve.parallel.channel import LeaderChannel
from pdserve.transfer.ranked_transport import RankedTransport
from pdserve.transfer.state_ranges import state_splits


@dataclass(frozen=True)
class PDSide:
    pool: PoolDescription
    kv_side: KVSide  # the connector, and for P and D the transport and handshake identity
    admission: KVAdmission


def _fingerprint(model_name: str, spec: ModelSpec) -> str:
    """What must be equal for two workers to share KV (whatever their TP sizes)."""
    return f"{model_name}|{spec.architecture}|{spec.num_layers}|{spec.hidden_size}|{spec.vocab_size}"


def _pool_description(model_name: str, model: ModelSide) -> PoolDescription:
    # The model's KV heads, not this rank's share: workers of any TP sizes may pair.
    spec, layout = model.spec, model.layout
    document = compatibility_document(_fingerprint(model_name, spec), str(model.dtype), spec.total_kv_heads,
                                      spec.head_dim, model.plan, 1 + len(model.follower_transports),
                                      kv_cache_dtype=str(model.kv_dtype))
    return PoolDescription(model.plan, layout.num_blocks, layout.block_size, layout.page_bytes,
                           compatibility_hash(document), document)


def _ranked(factory: TransportFactory, channel: Optional[LeaderChannel], followers: list,
            num_kv_heads: int, num_layer_slots: int, model: Optional[ModelSide] = None) -> TransportFactory:
    """Rank 0's transport (every P/D worker's, TP=1 included): its own slice's, reading each head
    from the peer rank that holds it, and commanding the other ranks' agents too. The pool's block
    size, attention page and state splits let it read peers of another block size (padded pages, state)
    or, with state, of another TP size (each rank its heads' bytes of every state slot)."""
    geometry: dict = {}
    if model is not None:
        geometry = dict(block_size=model.layout.block_size, kv_page_bytes=model.layout.kv_page_bytes,
                        state_splits=state_splits(model.plan, 1 + len(followers)))

    def make(pool_view, agent_name: str):  # type: ignore[no-untyped-def]
        return RankedTransport(factory(pool_view, agent_name), channel, followers, num_kv_heads, num_layer_slots,
                               **geometry)

    return make


def build_pd_side(config: WorkerConfig, metrics: Metrics, model: ModelSide, model_name: str,
                  transport_factory: TransportFactory, call_soon: Callable[[Callable[[], None]], None],
                  http_transport: Optional[httpx.AsyncBaseTransport] = None) -> PDSide:
    """`call_soon` runs a function on the engine thread (the loop's inbox): the admission connects
    peers there. The transport factory and the handshake's HTTP transport let in-process tests
    replace NIXL and the network."""
    factory = configured_transport(transport_factory, model.shared_pool, metrics)
    factory = _ranked(factory, model.channel, model.follower_transports, model.spec.total_kv_heads,
                      model.plan.group_size, model)
    pool = _pool_description(model_name, model)
    kv_side = build_kv_side(config, metrics, pool, model.layout.canonical_view(model.runner.pool), factory)
    admission = build_admission(config, metrics, pool, kv_side, call_soon, http_transport)
    return PDSide(pool, kv_side, admission)
