"""The worker's two apps: the serving app has no /internal/ route; the internal app has nothing else.
(That the worker mounts each router on the right one, and each app on its own port, is checked against
a real worker in tests/integration/test_pd_embedded.py.)"""

from __future__ import annotations

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient

from pdserve.api.config import ServerConfig
from pdserve.kv.routing_info import EVENTS_PATH, RESET_PREFIX_CACHE_PATH, ROUTING_INFO_PATH
from pdserve.metrics import create_metrics
from pdserve.pd.handshake import AGENT_INFO_PATH
from pdserve.server.app import create_internal_app
from pdserve.server.kv_events_routes import create_kv_events_router
from pdserve.server.kv_routes import RELEASE_PATH, create_kv_router
from tests.server.fake_engine import FakeEngine, make_app



ROUTES = [("GET", AGENT_INFO_PATH), ("POST", RELEASE_PATH), ("GET", ROUTING_INFO_PATH), ("GET", EVENTS_PATH),
          ("POST", RESET_PREFIX_CACHE_PATH)]


def statuses(app) -> list[int]:
    with TestClient(app) as client:
        return [client.request(method, path, json={}).status_code for method, path in ROUTES]


def test_the_serving_app_answers_404_for_every_internal_route():
    assert statuses(make_app(FakeEngine())) == [404] * len(ROUTES)


def test_the_internal_app_serves_the_kv_routers():
    engine, metrics = FakeEngine(), create_metrics()
    routers = [create_kv_events_router(engine, lambda: None, metrics, None),
               create_kv_router(lambda: None, None, release=lambda request_id: None)]
    # Nothing is loaded: 503 (or 400 for the empty release body), never 404.
    assert 404 not in statuses(create_internal_app(metrics, routers))


def test_the_internal_app_refuses_a_route_a_client_needs():
    router = APIRouter()
    router.add_api_route("/v1/models", lambda: {}, methods=["GET"])
    with pytest.raises(ValueError, match="only /internal/ routes"):
        create_internal_app(create_metrics(), [router])


@pytest.mark.parametrize("port, internal_port, expected", [
    (8100, None, 8101),  # the default: next to the serving port
    (8200, 9200, 9200),
    (0, None, 0),  # --port 0: any free port for both, recorded once bound
])
def test_the_internal_port_defaults_to_the_serving_port_plus_one(port, internal_port, expected):
    assert ServerConfig(port=port, internal_port=internal_port).internal_listen_port == expected


@pytest.mark.parametrize("port, internal_port, message", [
    (8100, 8100, "must differ from --port"),
    (65535, None, "pass --internal-port"),
])
def test_an_internal_port_that_cannot_be_its_own_is_refused(port, internal_port, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(port=port, internal_port=internal_port)
