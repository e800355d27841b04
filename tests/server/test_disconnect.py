"""A client that goes away aborts its engine request, streaming or not, at any point of the answer.

The app is driven through raw ASGI so the test decides exactly when the
client disconnects (httpx's ASGI transport cannot disconnect mid-request).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from tests.server.fake_engine import FakeEngine, make_app

from pdserve.api.config import ServerConfig
from pdserve.metrics import create_metrics
from pdserve.server.streaming import EventStreamResponse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class AsgiExchange:
    """One HTTP exchange whose client disconnects when `disconnect` is set, or whose sends start failing."""

    def __init__(self, app, body: dict, *, spec_version: str = "2.3", fail_sends_after: int | None = None,
                 stall_sends_after: int | None = None):
        self.app = app
        self.body = json.dumps(body).encode()
        self.spec_version = spec_version
        self.fail_sends_after = fail_sends_after
        self.stall_sends_after = stall_sends_after  # then sends never complete: a client that stopped reading
        self.disconnect = asyncio.Event()
        self.sent: list[dict] = []
        self._body_sent = False

    @property
    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m["body"]]

    async def run(self, path: str) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": self.spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        }
        await self.app(scope, self._receive, self._send)

    async def _receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if self.fail_sends_after is not None and len(self.body_chunks) >= self.fail_sends_after:
            raise OSError("connection reset by peer")
        if self.stall_sends_after is not None and len(self.body_chunks) >= self.stall_sends_after:
            await asyncio.Event().wait()  # never set: the socket's buffers are full for good
        self.sent.append(message)


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


def assert_cleaned_up(app, engine: FakeEngine, metrics) -> None:
    assert [r.request_id for r in engine.requests] == engine.aborted_ids
    assert engine.finished_ids == []
    assert len(app.state.serving.request_ids) == 0
    assert metrics.registry.get_sample_value("pdserve_request_finished_total", {"reason": "abort"}) == 1.0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
async def test_disconnect_during_non_streaming_generation_aborts_the_engine_request(path, body):
    engine, metrics = FakeEngine(reply="abcdef", stall_after_tokens=2), create_metrics()
    app = make_app(engine, metrics)
    exchange = AsgiExchange(app, body)
    task = asyncio.create_task(exchange.run(path))
    await wait_until(lambda: engine.requests)
    await asyncio.sleep(0.02)  # let it produce its two tokens and stall
    exchange.disconnect.set()
    await asyncio.wait_for(task, 5)
    assert_cleaned_up(app, engine, metrics)


async def test_disconnect_before_the_first_streamed_token_aborts_the_engine_request():
    engine, metrics = FakeEngine(stall_after_tokens=0), create_metrics()
    app = make_app(engine, metrics)
    exchange = AsgiExchange(app, {"prompt": "x", "stream": True})
    task = asyncio.create_task(exchange.run("/v1/completions"))
    await wait_until(lambda: engine.requests)
    exchange.disconnect.set()
    await asyncio.wait_for(task, 5)
    assert_cleaned_up(app, engine, metrics)
    assert exchange.body_chunks == []


async def test_disconnect_mid_stream_aborts_the_engine_request():
    engine, metrics = FakeEngine(reply="abcdef", stall_after_tokens=3), create_metrics()
    app = make_app(engine, metrics)
    exchange = AsgiExchange(app, {"messages": [{"role": "user", "content": "x"}], "stream": True})
    task = asyncio.create_task(exchange.run("/v1/chat/completions"))
    await wait_until(lambda: len(exchange.body_chunks) >= 4)  # role chunk + 3 tokens
    exchange.disconnect.set()
    await asyncio.wait_for(task, 5)
    assert_cleaned_up(app, engine, metrics)
    assert not any(b"[DONE]" in chunk for chunk in exchange.body_chunks)


async def test_failed_send_on_an_asgi_2_4_server_aborts_the_engine_request():
    # ASGI >= 2.4 servers report a gone client only by failing `send`.
    engine, metrics = FakeEngine(reply="abcdefgh", token_delay_s=0.005), create_metrics()
    app = make_app(engine, metrics)
    exchange = AsgiExchange(app, {"prompt": "x", "stream": True}, spec_version="2.4", fail_sends_after=2)
    await asyncio.wait_for(exchange.run("/v1/completions"), 5)
    assert_cleaned_up(app, engine, metrics)
    assert metrics.registry.get_sample_value("pdserve_request_errors_total", {"status": "500"}) is None


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(spec_version):
    # 1,000 tokens 20 ms apart: the answer is nowhere near its end when the client is dropped.
    engine, metrics = FakeEngine(reply="ab" * 500, token_delay_s=0.02), create_metrics()
    app = make_app(engine, metrics, server=ServerConfig(stream_send_timeout_s=0.2))
    exchange = AsgiExchange(app, {"prompt": "x", "stream": True}, spec_version=spec_version, stall_sends_after=2)
    await asyncio.wait_for(exchange.run("/v1/completions"), 10)  # it hung for ever before
    assert_cleaned_up(app, engine, metrics)
    assert app.state.serving.num_open_streams == 0  # the stream slot is free again
    assert len(exchange.body_chunks) == 2


async def test_event_stream_response_runs_its_cleanup_even_if_the_body_never_started():
    closed = []

    async def body():
        yield b"data: never\n\n"

    async def on_close():
        closed.append(True)

    async def failing_send(message):
        raise OSError("connection reset by peer")

    async def receive():
        return {"type": "http.disconnect"}

    response = EventStreamResponse(body(), on_close=on_close)
    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, failing_send)
    assert closed == [True]
