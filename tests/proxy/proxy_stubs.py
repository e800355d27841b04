"""Stub prefill/decode workers and a threaded uvicorn runner for the proxy's tests.

The stubs speak the workers' wire protocol (kv_transfer_params out of prefill,
SSE out of decode, /load, /v1/models) and record what they receive, so the
tests check the real proxy over real HTTP without loading a model. The few
tests at the bottom pin the stubs' own behaviour.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import build_components, create_app
from proxy.config import HealthConfig, ProxyConfig

PIN_NONCE = "ab" * 16  # the pin nonce the stub prefill worker hands out
STUB_HANDOFF_S = {"p_queue": 0.125, "p_compute": 0.25, "p_pin": 0.0625}  # the stub P's own handoff components


@dataclass
class RecordedCall:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class StubWorker:
    """One fake worker. Tests flip its fields to make it slow, failing or not ready."""

    role: str
    name: str
    calls: list[RecordedCall] = field(default_factory=list)
    ready: bool = True
    delay_s: float = 0.0  # before answering a generation request
    fail_status: Optional[int] = None  # answer every generation request with this status
    fail_type: str = "internal_error"
    num_kv_failures: int = 0  # decode: answer this many requests with 503 kv_pull_failed
    num_chunks: int = 3
    chunk_delay_s: float = 0.0
    break_after_chunks: Optional[int] = None  # decode: drop the connection mid-stream
    disconnects: list[str] = field(default_factory=list)  # request ids whose client went away
    releases: list[dict] = field(default_factory=list)  # prefill: bodies of POST /internal/kv/release
    hold: Optional[threading.Event] = None  # when set here and clear, generation waits until it is set
    says_recomputed: bool = False  # decode: answer P/D legs as a worker that computed their prompt itself
    # decode, concurrent legs: keys of legs waiting for their ticket, what POST /internal/kv/ticket delivered
    # (key, params or None), and the keys whose wait ended without a ticket (called off or the leg closed)
    waiting: dict[str, asyncio.Future] = field(default_factory=dict)
    deliveries: list[tuple[str, Optional[dict]]] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    takes_concurrent_legs: bool = True  # False: refuse awaited params by name, as a release before them would
    num_refused_awaited: int = 0  # awaited params so refused
    first_events: Optional[str] = None  # prefill: token 1's stream events, answered when the leg asks

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/load", self._load, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/internal/kv/release", self._release, methods=["POST"]),
            Route("/internal/kv/ticket", self._ticket, methods=["POST"]),
        ])

    async def _ticket(self, request: Request) -> Response:
        body = json.loads(await request.body())
        key, params = body["awaited_ticket"], body.get("kv_transfer_params")
        self.deliveries.append((key, params))
        waiter = self.waiting.get(key)
        if waiter is None or waiter.done():
            return JSONResponse({"status": "unknown"}, status_code=404)
        waiter.set_result(params)
        return JSONResponse({"status": "accepted"}, status_code=202)

    async def _awaited(self, request: Request, key: str) -> Optional[dict]:
        """A concurrent decode leg's wait for its ticket, until delivered, called off (a null delivery) or
        closed by the proxy (then None, recorded in `abandoned`)."""
        waiter = self.waiting[key] = asyncio.get_running_loop().create_future()

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait((waiter, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            del self.waiting[key]
        params = waiter.result() if waiter in done else None
        if params is None:
            self.abandoned.append(key)
        return params

    async def _release(self, request: Request) -> Response:
        self.releases.append(json.loads(await request.body()))
        return JSONResponse({"status": "accepted"}, status_code=202)

    async def _load(self, request: Request) -> Response:
        return JSONResponse({"ready": self.ready, "num_running": 0, "num_waiting": 0, "num_waiting_for_kv": 0,
                             "kv_usage": 0.0, "num_pinned_blocks": 0}, status_code=200 if self.ready else 503)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"}, status_code=200 if self.ready else 503)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": self.name}]})

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        request_id = request.headers.get("x-request-id", "")
        key = (body.get("kv_transfer_params") or {}).get("awaited_ticket")
        if key is not None and self.role == "decode":
            if not self.takes_concurrent_legs:
                self.num_refused_awaited += 1
                return JSONResponse({"error": {"message": "kv_transfer_params.remote_engine_id: Field required",
                                               "type": "invalid_request_error", "param": "kv_transfer_params",
                                               "code": 400}}, status_code=400)
            if self.fail_status is not None and self.hold is None:  # a failing worker fails before waiting
                return _error(self.fail_status, self.fail_type)
            params = await self._awaited(request, key)
            if params is None:
                return Response(status_code=499)
            body = {**body, "kv_transfer_params": params}  # recorded as a sequential leg would have been
        self.calls.append(RecordedCall(request.url.path, body, dict(request.headers)))
        while self.hold is not None and not self.hold.is_set():
            await asyncio.sleep(0.005)
        if self.delay_s and not await _sleep_unless_disconnected(request, self.delay_s):
            self.disconnects.append(request_id)
            return Response(status_code=499)
        if self.fail_status is not None:
            return _error(self.fail_status, self.fail_type)
        if self.role == "prefill":
            return JSONResponse({"id": request_id, "choices": [{"text": "x"}], "kv_transfer_params": self._params(body)})
        if self.num_kv_failures > 0 and body.get("kv_transfer_params"):
            self.num_kv_failures -= 1
            return _error(503, "kv_pull_failed")
        source = (body.get("kv_transfer_params") or {}).get("remote_engine_id", "local")
        headers = {"X-Pdserve-KV-Recomputed": "1"} if self.says_recomputed and body.get("kv_transfer_params") else {}
        if body.get("stream"):
            return StreamingResponse(self._events(source, request_id), media_type="text/event-stream", headers=headers)
        return JSONResponse({"id": request_id, "object": "text_completion",
                             "choices": [{"index": 0, "text": f"from {source}", "finish_reason": "stop"}]},
                            headers=headers)

    def _params(self, body: dict) -> dict:
        if self.first_events is not None and body["kv_transfer_params"].get("want_first_events"):
            return {**self._pin(), "first_events": self.first_events}
        return self._pin()

    def _pin(self) -> dict:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                "remote_request_id": "p-1", "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1",
                "remote_port": 1, "tp_size": 1, "remote_epoch": f"{self.name}-epoch", "remote_pin_nonce": PIN_NONCE,
                "handoff_s": dict(STUB_HANDOFF_S)}

    async def _events(self, source: str, request_id: str):
        try:
            for index in range(self.num_chunks):
                if index == self.break_after_chunks:
                    raise RuntimeError("stub decode worker crashes mid-stream")
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                chunk = {"choices": [{"index": 0, "text": f"{source}-{index}", "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects.append(request_id)
            raise


async def _sleep_unless_disconnected(request: Request, delay_s: float) -> bool:
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    sleeper = asyncio.ensure_future(asyncio.sleep(delay_s))
    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait((sleeper, watcher), return_when=asyncio.FIRST_COMPLETED)
    sleeper.cancel()
    watcher.cancel()
    return sleeper in done


def _error(status: int, error_type: str) -> Response:
    return JSONResponse({"error": {"message": f"stub says {error_type}", "type": error_type,
                                   "param": None, "code": status}}, status_code=status)


class Served:
    """An ASGI app on 127.0.0.1 in a uvicorn thread; `url` is where it listens."""

    def __init__(self, app: Any, port: int = 0, lifespan: str = "auto"):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "Served":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


class DroppingWorker:
    """A worker that dies with every request it takes: it reads the request whole, then closes the
    connection without a byte of answer (what the proxy sees when a worker is SIGKILLed mid-request)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data)

    def close(self) -> None:
        self._listener.close()


def unused_url() -> str:
    """A URL nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def fast_config(prefill_urls, decode_urls, **overrides) -> ProxyConfig:
    """Health polls every 50 ms so that the tests never wait long for a state change."""
    health = overrides.pop("health", HealthConfig(interval_s=0.05, timeout_s=0.5, breaker_cooldown_s=0.5))
    return ProxyConfig(prefill_urls=tuple(prefill_urls), decode_urls=tuple(decode_urls), health=health, **overrides)


class ServedProxy(Served):
    """The real proxy app with its lifespan (health loop), plus a handle on its internals."""

    def __init__(self, config: ProxyConfig, resolver: Any = None):
        self.components = build_components(config, resolver)
        super().__init__(create_app(config, components=self.components), lifespan="on")

    def wait_ready(self, timeout_s: float = 5.0) -> "ServedProxy":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                return self
            time.sleep(0.02)
        raise TimeoutError("proxy not ready")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for family in self.components.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total
