"""Who may reach a worker's internal KV-event routes: with a token, its holders; without one, only
callers on a loopback-only worker (a colocated worker serving the public API keeps them shut)."""

from __future__ import annotations

from typing import Optional

import pytest

from pdserve.kv.routing_info import EVENTS_PATH, RESET_PREFIX_CACHE_PATH, ROUTING_INFO_PATH
from pdserve.metrics import create_metrics
from pdserve.server.app import create_internal_app
from pdserve.server.errors import INTERNAL_TOKEN_HEADER
from pdserve.server.kv_events_routes import create_kv_events_router
from tests.server.fake_engine import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio
ROUTES = [("GET", EVENTS_PATH), ("GET", ROUTING_INFO_PATH), ("POST", RESET_PREFIX_CACHE_PATH)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def app(token: Optional[str], open_without_token: bool):
    engine, metrics = FakeEngine(), create_metrics()
    # No engine is built: a caller let through gets 503 (not ready), one kept out 401.
    router = create_kv_events_router(engine, lambda: None, metrics, token, open_without_token=open_without_token)
    return create_internal_app(metrics, [router])


async def statuses(application, headers: Optional[dict] = None) -> list[int]:
    async with asgi_client(application) as client:
        return [(await client.request(method, path, headers=headers or {})).status_code for method, path in ROUTES]


async def test_without_a_token_the_internal_routes_are_shut_off_loopback_and_open_on_it():
    assert await statuses(app(None, open_without_token=False)) == [401, 401, 401]
    assert await statuses(app(None, open_without_token=True)) == [503, 503, 503]


async def test_with_a_token_only_its_holders_get_through_wherever_the_worker_listens():
    for open_without_token in (False, True):
        application = app("s3cret", open_without_token)
        assert await statuses(application) == [401, 401, 401]
        assert await statuses(application, {INTERNAL_TOKEN_HEADER: "s3cret"}) == [503, 503, 503]
