"""Which internal routes a worker mounts for what it lends: with peer pulls on, a decode worker serves the
peer pin route and the release route as a prefill worker does, behind the same internal token."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pdserve.api.config import ServerConfig, TransferConfig, WorkerConfig
from pdserve.api.peer_pull import PEER_PIN_PATH
from pdserve.app.worker import _internal_routers, _Loaded
from pdserve.engine.async_engine import LoadingEngine
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.metrics import create_metrics
from pdserve.server.app import create_internal_app
from pdserve.server.kv_routes import RELEASE_PATH

TOKEN = {"X-Pdserve-Internal-Token": "t"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("peer_pull", [True, False])
def test_every_worker_with_peer_pulls_lends_behind_the_token_and_serves_the_release(role, peer_pull):
    """A decode worker mounts the pin route (and the release route a puller frees a pin by) as a prefill
    worker does, with the same token rule; without peer pulls D has neither (P keeps its P/D release)."""
    config = WorkerConfig(role=role, server=ServerConfig(internal_token="t"),
                          transfer=TransferConfig(peer_pull=peer_pull))
    metrics = create_metrics()
    handle = LoadingEngine("m", RequestIdRegistry())
    app = create_internal_app(metrics, _internal_routers(config, metrics, handle, _Loaded()))
    release = {"remote_request_id": "peer-pin-1", "remote_engine_id": "D", "remote_epoch": "e",
               "remote_pin_nonce": "ab" * 16}
    with TestClient(app) as client:
        without_token = client.post(PEER_PIN_PATH, json={"token_ids": [1]}).status_code
        pin = client.post(PEER_PIN_PATH, json={"token_ids": [1]}, headers=TOKEN).status_code
        released = client.post(RELEASE_PATH, json=release, headers=TOKEN).status_code
    if peer_pull:
        assert (without_token, pin, released) == (401, 503, 503)  # guarded; the engine is still loading
    else:
        assert (without_token, pin) == (404, 404) and released == (503 if role == "prefill" else 404)
