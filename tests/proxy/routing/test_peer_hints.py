"""Peer hints: a leg that computes a prompt (a prefill leg, a decode-only leg) to a worker that holds less of
it than another worker, prefill or decode (by the KV index, whatever the policies), carries a hint naming
that worker's internal listener; never when the margin is not met, the peer is unavailable or names no
internal listener, and never a hint a client sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Optional

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint, parse_peer_hint
from proxy.app import build_components
from proxy.client_request import parse_client_request
from proxy.kv_release import PrefillHold
from proxy.legs import OpenLeg
from proxy.routing.kv_index import CachedPrefix
from proxy.routing.peer_hints import PeerView, choose_peer_hint
from tests.kv.kv_stubs import BLOCK, KVStubWorker
from proxy.config import HealthConfig, RoutingConfig
from tests.proxy.proxy_stubs import Served, ServedProxy, fast_config
from tests.proxy.routing.test_kv_routing import BODY, index_synced, prompt, wait_until  # noqa: F401


def view(num_tokens: int, available: bool = True, port: Optional[int] = 9000, host: str = "10.0.0.2") -> PeerView:
    return PeerView(host, port, available, CachedPrefix(num_tokens))


def test_the_peer_with_the_longest_device_prefix_is_hinted_past_the_margin():
    peers = [view(64, host="a"), view(128, host="b"), view(256, available=False, host="c")]
    assert choose_peer_hint(CachedPrefix(0), peers, margin_tokens=64) == PeerHint(host="b", port=9000, num_tokens=128)
    assert choose_peer_hint(CachedPrefix(80), peers, margin_tokens=64) is None  # 48 more: under the margin
    assert choose_peer_hint(None, [view(128, port=None)], margin_tokens=1) is None  # no internal listener known
    assert choose_peer_hint(None, [view(0)], margin_tokens=1) is None
    # A prefix that continues in the peer's offload tier counts whole (the peer loads it before pinning),
    # and so does the chosen worker's own tier.
    tiered = PeerView("t", 9000, True, CachedPrefix(num_tokens=256, num_offload_tokens=200))
    assert choose_peer_hint(None, [tiered], margin_tokens=64) == PeerHint(host="t", port=9000, num_tokens=256,
                                                                          medium="offload")
    assert choose_peer_hint(CachedPrefix(200, num_offload_tokens=200), [tiered], margin_tokens=64) is None


@dataclass
class ListeningStub(KVStubWorker):
    """A stub whose /load names an internal listener (its own serving port: it serves the internal routes too)."""

    internal_port: Optional[int] = None

    async def _load(self, request: Request) -> Response:
        answer = await super()._load(request)
        body = {**json.loads(answer.body), "internal_port": self.internal_port}
        return JSONResponse(body, status_code=answer.status_code)


def test_round_robin_prefill_legs_carry_a_hint_to_the_holder_and_never_the_clients(prompt):  # noqa: F811
    cold = ListeningStub("prefill", "p-cold")
    warm = ListeningStub("prefill", "p-warm", held=list(prompt.block_hashes(BLOCK)[:4]))
    decode = KVStubWorker("decode", "d0")
    with Served(cold.app()) as c, Served(warm.app()) as w, Served(decode.app()) as d:
        cold.internal_port, warm.internal_port = httpx.URL(c.url).port, httpx.URL(w.url).port
        routing = RoutingConfig(prefill_policy="round_robin", decode_policy="round_robin", peer_pull=True,
                                peer_pull_margin_tokens=BLOCK)
        config = fast_config([c.url, w.url], [d.url], routing=routing,
                             health=HealthConfig(interval_s=0.05, timeout_s=5.0, breaker_cooldown_s=0.5))
        with ServedProxy(config) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, c.url, w.url)
                       and all(b.load.internal_port for b in proxy.components.prefill_pool.backends()))
            forged = {PEER_HINT_HEADER: "evil.example:1;tokens=999"}
            for _ in range(4):
                response = httpx.post(proxy.url + "/v1/chat/completions", json=BODY, headers=forged, timeout=10)
                assert response.status_code == 200
    assert len(cold.calls) == len(warm.calls) == 2
    hints = [parse_peer_hint(call.headers.get(PEER_HINT_HEADER.lower(), "")) for call in cold.calls]
    assert hints == [PeerHint(host="127.0.0.1", port=warm.internal_port, num_tokens=4 * BLOCK)] * 2
    assert all(PEER_HINT_HEADER.lower() not in call.headers for call in warm.calls)  # it holds the most already
    assert proxy.metric("pdserve_proxy_peer_hints_total") == 2


@pytest.mark.parametrize("num_prefill", [1, 2])
def test_a_decode_worker_that_holds_more_of_the_prompt_is_hinted_to_the_prefill_leg(prompt, num_prefill):  # noqa: F811
    """D lends too: the proxy follows decode workers' KV events when peer pulls are on, and a decode worker
    holding the conversation (its answers included) is named to a prefill worker holding none of it; with
    one prefill worker too (`pdserve up`'s default: before, a lone P meant no index and no hint)."""
    cold = [ListeningStub("prefill", f"p{i}") for i in range(num_prefill)]
    warm = ListeningStub("decode", "d-warm", held=list(prompt.block_hashes(BLOCK)[:4]))
    with contextlib.ExitStack() as stack:
        served_cold = [stack.enter_context(Served(stub.app())) for stub in cold]
        d = stack.enter_context(Served(warm.app()))
        for stub, served in (*zip(cold, served_cold), (warm, d)):
            stub.internal_port = httpx.URL(served.url).port
        routing = RoutingConfig(prefill_policy="round_robin", decode_policy="round_robin", peer_pull=True,
                                peer_pull_margin_tokens=BLOCK)
        urls = [served.url for served in served_cold]
        config = fast_config(urls, [d.url], routing=routing,
                             health=HealthConfig(interval_s=0.05, timeout_s=5.0, breaker_cooldown_s=0.5))
        with ServedProxy(config) as proxy:
            proxy.wait_ready()
            pools = (proxy.components.prefill_pool, proxy.components.decode_pool)
            wait_until(lambda: index_synced(proxy, *urls, d.url)
                       and all(b.load.internal_port for pool in pools for b in pool.backends()))
            for _ in range(2):
                assert httpx.post(proxy.url + "/v1/chat/completions", json=BODY, timeout=10).status_code == 200
    calls = [call for stub in cold for call in stub.calls]
    assert len(calls) == 2
    hints = [parse_peer_hint(call.headers.get(PEER_HINT_HEADER.lower(), "")) for call in calls]
    assert hints == [PeerHint(host="127.0.0.1", port=warm.internal_port, num_tokens=4 * BLOCK)] * 2


class _Hinting:
    """Stands in for PeerHints: every leg that computes a prompt gets this header."""

    def headers_for(self, backend, request):
        return {PEER_HINT_HEADER: "127.0.0.1:9;tokens=64"}


class _RecordingSender:
    def __init__(self) -> None:
        self.headers: list = []

    async def open_decode(self, backend, request, params, extra_headers=None):
        self.headers.append(extra_headers)
        return OpenLeg(backend, httpx.Response(200), started_s=1.0, headers_s=1.5)


def test_a_decode_only_leg_carries_the_hint_and_a_leg_with_ps_kv_does_not():
    """D from D, D from P: a decode worker that computes the prompt itself (no prefill leg) is told where
    a longer prefix is, as a prefill worker is; a decode leg that reads P's KV has nothing to compute."""
    components = build_components(fast_config(["http://p:1", "http://p:2"], ["http://d:1"]))
    forwarder, sender = components.forwarder, _RecordingSender()
    forwarder._sender, forwarder._hints = sender, _Hinting()
    backend = components.decode_pool.backends()[0]
    body = json.dumps({"model": "m", "prompt": [7] * 100, "max_tokens": 4}).encode()
    request = parse_client_request("/v1/completions", body, "rid", 4.0)
    asyncio.run(forwarder._open_decode(backend, request, None, None))  # decode-only: D computes the prompt
    asyncio.run(forwarder._open_decode(backend, request, {"remote_engine_id": "p"}, PrefillHold(backend, {})))
    assert sender.headers == [{PEER_HINT_HEADER: "127.0.0.1:9;tokens=64"}, None]
