"""Real prefill, decode and colocated workers in one process: real engines (tiny Qwen3) behind their real
HTTP apps, with the fake transport moving pages and the handshake routed to the prefill app in memory."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import httpx
from fastapi import FastAPI

from pdserve.api.config import CacheConfig, ModelConfig, ServerConfig, TransferConfig, WorkerConfig
from pdserve.app.engine_factory import BuiltEngine, build_engine
from pdserve.metrics import Metrics
from pdserve.server.app import create_app
from pdserve.server.kv_routes import create_kv_router
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport

PREFILL_PORT = 8100
DECODE_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class InProcessWorker:
    built: BuiltEngine
    app: FastAPI
    metrics: Metrics
    transports: list[FakeTransport] = field(default_factory=list)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://worker.test", timeout=60)

    @property
    def transport(self) -> FakeTransport:
        return self.transports[0]

    def close(self) -> None:
        self.built.close()


def start_worker(role: str, model_path: str, fabric: FakeFabric, *, prefill_app: Optional[FastAPI] = None,
                 transfer: Optional[dict[str, Any]] = None, num_blocks: int = 256,
                 max_model_len: Optional[int] = None) -> InProcessWorker:
    config = WorkerConfig(
        role=role,
        model=ModelConfig(path=model_path, device="cpu", dtype="float32", num_threads=1, max_model_len=max_model_len),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        server=ServerConfig(port=PREFILL_PORT if role == "prefill" else 8200),
        transfer=TransferConfig(**(transfer or {})),
    )
    metrics = Metrics()
    transports: list[FakeTransport] = []

    def fake_transport(view, agent_name: str) -> FakeTransport:
        transports.append(FakeTransport(view, agent_name, fabric))
        return transports[-1]

    handshake_route = httpx.ASGITransport(app=prefill_app) if prefill_app is not None else None
    built = build_engine(config, metrics, transport_factory=fake_transport, http_transport=handshake_route)
    built.engine.start()
    prefill = role == "prefill"
    routers = [] if role == "colocated" else [create_kv_router(lambda: built.agent_info, None,
                                                               built.release_pinned if prefill else None,
                                                               built.claim_ticket if prefill else None)]
    app = create_app(built.engine, metrics, config.server)
    for router in routers:  # in process, one ASGI app stands for both of a worker's listeners
        app.include_router(router)
    return InProcessWorker(built, app, metrics, transports)


def metric_value(metrics: Metrics, name: str) -> float:
    total = 0.0
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def tiny_qwen3_trio(directory: str) -> Iterator[tuple[InProcessWorker, InProcessWorker, InProcessWorker]]:
    """(colocated, prefill, decode) of one tiny Qwen3 written to `directory`, over one fake fabric; D
    pulls from P with its default policies."""
    from tests.tiny_models import make_tiny_qwen3

    make_tiny_qwen3(directory)
    fabric = FakeFabric()
    colocated = start_worker("colocated", directory, fabric)
    prefill = start_worker("prefill", directory, fabric)
    decode = start_worker("decode", directory, fabric, prefill_app=prefill.app)
    try:
        yield colocated, prefill, decode
    finally:
        for worker in (decode, prefill, colocated):
            worker.close()


async def complete(worker: InProcessWorker, body: dict, request_id: str = "") -> dict:
    """One /v1/completions answer, which must be a 200."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with worker.client() as client:
        response = await client.post("/v1/completions", headers=headers, json=body)
    assert response.status_code == 200, response.text
    return response.json()
