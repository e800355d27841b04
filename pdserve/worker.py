"""Composition root of a worker process: config -> metrics, engine, app -> uvicorn.

The HTTP server comes up first and answers 503 on /health until the weights
are loaded, so orchestrators can tell "loading" from "dead".
"""

from __future__ import annotations

import logging
import threading

import uvicorn

from pdserve.config import WorkerConfig
from pdserve.engine.async_engine import LoadingEngine
from pdserve.engine.factory import build_engine
from pdserve.metrics import Metrics
from pdserve.server.app import create_app

logger = logging.getLogger(__name__)


def _load_in_background(config: WorkerConfig, metrics: Metrics, handle: LoadingEngine) -> threading.Thread:
    def load() -> None:
        try:
            built = build_engine(config, metrics)
            built.engine.start()
            handle.inner = built.engine
        except Exception as error:  # reported on every request and in the log
            logger.exception("model load failed")
            handle.load_error = f"model failed to load: {error}"

    thread = threading.Thread(target=load, name="pdserve-loader", daemon=True)
    thread.start()
    return thread


def serve_worker(config: WorkerConfig) -> None:
    metrics = Metrics()
    handle = LoadingEngine(config.model.served_name or "default")
    app = create_app(handle, metrics, config.server)
    _load_in_background(config, metrics, handle)
    try:
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level)
    finally:
        if handle.inner is not None:
            handle.inner.shutdown()
