"""The proxy calls a worker's /internal/* routes on the internal listener its /load names, never on
its serving port (where a current worker answers 404 for them)."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.backends import BackendPool, LoadReport, Role, client_factory
from proxy.kv_release import KVReleaser, PrefillHold
from proxy.metrics import create_proxy_metrics
from tests.proxy.proxy_stubs import Served, fast_config

PARAMS = {"remote_request_id": "r-1", "remote_engine_id": "p0", "remote_epoch": "e0", "remote_pin_nonce": "ab" * 16}


def recording(calls: list[str]) -> Starlette:
    async def record(request: Request) -> Response:
        calls.append(f"{request.method} {request.url.path} {json.loads(await request.body() or b'null')}")
        return JSONResponse({"status": "accepted"}, status_code=202)

    return Starlette(routes=[Route("/internal/kv/release", record, methods=["POST"])])


def test_a_release_goes_to_the_internal_port_the_workers_load_named():
    serving_calls: list[str] = []
    internal_calls: list[str] = []
    with Served(recording(serving_calls)) as serving, Served(recording(internal_calls)) as internal:
        config = fast_config([serving.url], [serving.url])

        async def release() -> str:
            pool = BackendPool(Role.PREFILL, config, client_factory(config))
            backend = pool.add(serving.url)
            backend.load = LoadReport.from_json({"ready": True, "internal_port": internal.port})
            releaser = KVReleaser(create_proxy_metrics(pool.backends), timeout_s=5.0)
            releaser.release_unless_read(PrefillHold(backend, dict(PARAMS)), "r-1")
            await releaser.aclose()
            url = str(backend.internal_client.base_url)
            await pool.aclose()
            return url

        assert asyncio.run(release()).rstrip("/") == internal.url
    assert serving_calls == []
    assert internal_calls == [f"POST /internal/kv/release {PARAMS}"]


def test_a_load_report_names_only_a_real_port():
    for body in ({}, {"internal_port": "8101"}, {"internal_port": True}, {"internal_port": 0},
                 {"internal_port": 70000}):
        assert LoadReport.from_json(body).internal_port is None, body
    assert LoadReport.from_json({"internal_port": 8101}).internal_port == 8101
