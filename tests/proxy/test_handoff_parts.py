"""The proxy's per-request handoff components over real HTTP (stub workers): its histogram and its log line."""

from __future__ import annotations

import logging

import httpx

from pdserve.api.handoff import PROXY_LOG_COMPONENTS
from tests.proxy.forwarder_fixtures import BODY, cluster, proxy, stubs  # noqa: F401
from tests.proxy.proxy_stubs import STUB_HANDOFF_S


def test_a_streamed_pd_request_publishes_every_component_once(cluster, proxy, caplog):
    caplog.set_level(logging.INFO, logger="proxy.forwarder")
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**BODY, "stream": True},
                      headers={"X-Request-Id": "hand-1"}) as response:
        assert response.status_code == 200
        response.read()
    for component in PROXY_LOG_COMPONENTS:
        assert proxy.metric("pdserve_proxy_handoff_seconds_count", mode="disaggregated", component=component) == 1, \
            component
    for component, seconds in STUB_HANDOFF_S.items():  # P's own, as it reported them
        assert proxy.metric("pdserve_proxy_handoff_seconds_sum", component=component) == seconds
    [line] = [r.getMessage() for r in caplog.records if "handoff" in r.getMessage()]
    assert line.startswith("request hand-1: handoff mode=disaggregated proxy_hop_ms=")
    assert "p_queue_ms=125.000 p_compute_ms=250.000 p_pin_ms=62.500 " in line and "client_first_byte_ms=" in line


def test_a_non_streamed_answer_has_no_client_first_byte_but_the_rest(cluster, proxy):
    response = httpx.post(proxy.url + "/v1/completions", json=BODY)
    assert response.status_code == 200
    assert proxy.metric("pdserve_proxy_handoff_seconds_count", component="decode_first_byte") == 1
    assert proxy.metric("pdserve_proxy_handoff_seconds_count", component="p_compute") == 1
    assert proxy.metric("pdserve_proxy_handoff_seconds_count", component="client_first_byte") == 0
