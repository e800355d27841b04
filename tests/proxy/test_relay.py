"""The proxy's relay of decode's stream: a client that stops reading is dropped, and the decode leg
is closed (so the decode worker aborts the request) instead of both waiting for ever."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from proxy.backends import Backend, Role
from proxy.breaker import CircuitBreaker
from proxy.legs import OpenLeg
from proxy.relay import RelayStreamResponse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_client_that_stops_reading_is_dropped_and_the_decode_leg_closed():
    async def decode_events():
        for index in range(10_000):  # far more than the stalled client will ever take
            yield f"data: {index}\n\n".encode()
            await asyncio.sleep(0)

    backend = Backend("http://d0", Role.DECODE, httpx.AsyncClient(), CircuitBreaker(3, 5.0))
    backend.begin()
    leg = OpenLeg(backend, httpx.Response(200, content=decode_events()), 0.0, 0.0)
    outcomes: list[str] = []
    relay = RelayStreamResponse(leg, lambda now_s: None, outcomes.append, {}, send_timeout_s=0.2)
    sent: list[dict] = []

    async def stalling_send(message: dict) -> None:
        if len(sent) >= 3:  # the headers and two events, then the client's buffers stay full
            await asyncio.Event().wait()
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never hangs up: it only stops reading
        return {"type": "http.disconnect"}

    await asyncio.wait_for(relay({"type": "http"}, receive, stalling_send), 10)  # it hung for ever before
    assert leg.response.is_closed and leg.ended and backend.num_in_flight == 0  # decode's leg is closed
    assert outcomes == [] and backend.breaker.state.name == "CLOSED"  # the worker is not blamed
    assert len(sent) == 3 and sent[0]["type"] == "http.response.start"
