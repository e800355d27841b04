"""Composition root of a worker process: config -> metrics, engine, apps -> two uvicorn listeners.

The HTTP server comes up first and answers 503 on /health until the weights
are loaded, so orchestrators can tell "loading" from "dead". The /internal/*
routes live on their own listener (--internal-port), never on the serving port.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import uvicorn

from pdserve.api.config import WorkerConfig, is_loopback_host
from pdserve.api.http_bounds import http_protocol_with_header_deadline
from pdserve.app.listeners import InternalServer, WorkerServer, bind_listener, bound_port
from pdserve.app.ranks import LocalRanks, start_local_ranks, stop_local_ranks
from pdserve.engine.async_engine import LoadingEngine
from pdserve.app.engine_factory import BuiltEngine, build_engine
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.metrics import Metrics
from pdserve.pd.wiring import TransportFactory, nixl_transport
from pdserve.server.app import create_app, create_internal_app
from pdserve.server.kv_events_routes import create_kv_events_router
from pdserve.server.kv_routes import create_kv_router
from pdserve.server.peer_routes import create_peer_pin_router

logger = logging.getLogger(__name__)


@dataclass
class _Loaded:
    built: Optional[BuiltEngine] = None


def _load_in_background(config: WorkerConfig, metrics: Metrics, handle: LoadingEngine, loaded: _Loaded,
                        transport_factory: TransportFactory, local_ranks: Optional[LocalRanks]) -> threading.Thread:
    def load() -> None:
        try:
            built = build_engine(config, metrics, request_ids=handle.request_ids, transport_factory=transport_factory,
                                 local_ranks=local_ranks)
            built.engine.start()
            loaded.built = built
            handle.inner = built.engine
        except Exception as error:  # /live turns 503 and the process exits non-zero
            logger.exception("model load failed")
            handle.load_error = f"model failed to load: {error}"

    thread = threading.Thread(target=load, name="pdserve-loader", daemon=True)
    thread.start()
    return thread


def _bind_listeners(config: WorkerConfig) -> tuple[WorkerConfig, list]:
    """Bind the serving and the internal socket now, and record the ports they got in the config
    (`--port 0` picks a free one): P names its internal port to decode workers as remote_port."""
    server = config.server
    serving = bind_listener(server.host, server.port)
    try:
        internal = bind_listener(server.host, server.internal_listen_port)
    except OSError:
        serving.close()
        raise
    ports = {"port": bound_port(serving), "internal_port": bound_port(internal)}
    logger.info("serving on %s:%d, internal routes on %s:%d", server.host, ports["port"], server.host,
                ports["internal_port"])
    return config.model_copy(update={"server": server.model_copy(update=ports)}), [serving, internal]


def _internal_routers(config: WorkerConfig, metrics: Metrics, handle: LoadingEngine, loaded: _Loaded) -> list:
    internal_open = is_loopback_host(config.server.host) or config.server.insecure_no_token
    routers = [create_kv_events_router(handle, lambda: loaded.built, metrics, config.server.internal_token,
                                       open_without_token=internal_open)]
    if config.role != "colocated":
        def release(request_id: str, nonce: str) -> None:  # the route answers 503 until the engine is built
            if loaded.built is not None:
                loaded.built.release_pinned(request_id, nonce)

        def claim(request_id: str, nonce: str):  # None until the engine is built (503)
            return loaded.built.claim_ticket(request_id, nonce) if loaded.built is not None else None

        def deliver(key: str, params: Optional[dict]):  # None until the engine is built (503)
            return loaded.built.deliver_ticket(key, params) if loaded.built is not None else None

        prefill = config.role == "prefill"
        lends = prefill or config.transfer.peer_pull  # D lends its prefixes to peers: pins a puller may release
        routers.append(create_kv_router(lambda: loaded.built.agent_info if loaded.built else None,
                                        config.server.internal_token, release if lends else None,
                                        claim if prefill else None, None if prefill else deliver))
        if config.transfer.peer_pull:  # P and D alike pin prefixes for peers (a model without: 409)
            routers.append(create_peer_pin_router(
                lambda token_ids: loaded.built.pin_peer_prefix(token_ids) if loaded.built is not None else None,
                config.server.internal_token))
    return routers


def serve_worker(config: WorkerConfig, transport_factory: TransportFactory = nixl_transport) -> int:
    """Serve until told to stop; returns the process exit status (1 when the worker could not serve).
    A tensor-parallel worker started without --tp-rank starts its other ranks on this host first."""
    try:
        config, (serving_socket, internal_socket) = _bind_listeners(config)
    except OSError as error:
        logger.error("cannot listen on %s (port %d or internal port %d): %s", config.server.host, config.server.port,
                     config.server.internal_listen_port, error)
        return 1
    local: Optional[LocalRanks] = None
    if config.parallel.tensor_parallel_size > 1 and config.parallel.tp_rank is None:
        local = start_local_ranks(config)
        config = local.config
    metrics = Metrics()
    handle = LoadingEngine(config.model.served_name or "default", RequestIdRegistry())
    loaded = _Loaded()
    app = create_app(handle, metrics, config.server, limits=config.limits)
    internal_app = create_internal_app(metrics, _internal_routers(config, metrics, handle, loaded))
    loader = _load_in_background(config, metrics, handle, loaded, transport_factory, local)
    http = http_protocol_with_header_deadline(config.limits.header_timeout_s)
    internal = InternalServer(uvicorn.Config(internal_app, log_level=config.server.log_level, http=http))
    uvicorn_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                    log_level=config.server.log_level, http=http)
    server = WorkerServer(uvicorn_config, internal, internal_socket, lambda: handle.inner,
                          config.server.drain_timeout_s, is_alive=handle.is_alive)
    try:
        server.run(sockets=[serving_socket])
    finally:
        built = loaded.built
        if built is not None:
            built.close()
        stop_local_ranks(local.children if local is not None else [], told_to_stop=built is not None)
    status = 1 if server.died else 0
    if built is None and loader.is_alive():
        _exit_before_the_load_ends(status)
    return status


def _exit_before_the_load_ends(status: int) -> None:
    """Stopped while the model still loads: leave without the interpreter's finalization. The loader
    thread may be inside native code (torch.distributed's store and process group, a collective, a
    kernel build), and C++ destructors running beside it at exit abort the process ("terminate
    called without an active exception", exit 134) instead of the clean exit a stop deserves."""
    logger.info("stopped before the model finished loading: leaving without waiting for it")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
