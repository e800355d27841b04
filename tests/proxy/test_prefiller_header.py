"""llm-d's `x-prefiller-host-port`: the proxy honours it only for a prefill worker it knows, and never
connects to an address a client chose (stub workers over real HTTP, the real proxy in front)."""

from __future__ import annotations

import httpx

from tests.proxy.forwarder_fixtures import BODY, cluster, proxy, start_proxy, stubs  # noqa: F401
from tests.proxy.test_forwarder import wait_until


def host_port(url: str) -> str:
    return url.split("://", 1)[1]


def test_a_named_known_prefill_worker_takes_the_request(cluster, proxy):
    workers, urls = cluster
    for _ in range(3):  # round robin would alternate: the header pins p1
        response = httpx.post(proxy.url + "/v1/completions", json=BODY,
                              headers={"x-prefiller-host-port": host_port(urls["p1"])})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "from p1"
    assert workers["p0"].calls == [] and len(workers["p1"].calls) == 3


def test_an_address_the_proxy_does_not_know_is_ignored_and_never_contacted(cluster, proxy):
    """The header then says nothing: the usual choice serves the request, and no address a client
    chose is ever connected to."""
    workers, _ = cluster
    for named in ("169.254.169.254:80", "127.0.0.1:1", "p0"):
        response = httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"x-prefiller-host-port": named})
        assert response.status_code == 200, response.text
    assert len(workers["p0"].calls) + len(workers["p1"].calls) == 3 and len(workers["d0"].calls) == 3


def test_an_unknown_address_and_an_unavailable_backend_get_the_same_answer(cluster, proxy):
    """No oracle for the backend list (issue 36, item 9): a client cannot tell a name the proxy knows
    but cannot use now from one it has never heard of."""
    workers, urls = cluster
    workers["p1"].ready = False
    assert wait_until(lambda: not proxy.components.prefill_pool.get(urls["p1"]).healthy)
    answers = []
    for named in (host_port(urls["p1"]), "10.1.2.3:8100"):
        response = httpx.post(proxy.url + "/v1/completions", json=BODY, headers={"x-prefiller-host-port": named})
        answers.append((response.status_code, response.json()["choices"][0]["text"],
                        {k: v for k, v in response.headers.items() if k not in ("date", "x-request-id")}))
    assert answers[0] == answers[1]
    assert answers[0][:2] == (200, "from p0") and workers["p1"].calls == []


def test_a_named_worker_that_is_not_available_is_replaced_by_another(cluster, proxy):
    workers, urls = cluster
    workers["p1"].ready = False
    assert wait_until(lambda: not proxy.components.prefill_pool.get(urls["p1"]).healthy)
    response = httpx.post(proxy.url + "/v1/completions", json=BODY,
                          headers={"x-prefiller-host-port": host_port(urls["p1"])})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "from p0"
    assert workers["p1"].calls == []
