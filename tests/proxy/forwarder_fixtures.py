"""The stub workers and the proxy in front of them, shared by the forwarder's test modules (imported
by name: pytest finds fixtures in a test module's namespace)."""

from __future__ import annotations

import pytest

from proxy.config import HealthConfig, RoutingConfig
from tests.proxy.proxy_stubs import Served, ServedProxy, StubWorker, fast_config

SLOW_POLLS = HealthConfig(interval_s=60)  # the first poll only: the test plays the backend's death itself
BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def stubs():
    workers = {"p0": StubWorker("prefill", "p0"), "p1": StubWorker("prefill", "p1"), "d0": StubWorker("decode", "d0")}
    served = {name: Served(worker.app()).__enter__() for name, worker in workers.items()}
    yield workers, {name: s.url for name, s in served.items()}
    for s in served.values():
        s.__exit__(None, None, None)


@pytest.fixture
def cluster(stubs):
    workers, urls = stubs
    for name, worker in workers.items():
        fresh = StubWorker(worker.role, name)
        worker.__dict__.update({k: v for k, v in fresh.__dict__.items()})
    return workers, urls


def start_proxy(prefill_urls, decode_urls, **overrides) -> ServedProxy:
    overrides.setdefault("routing", RoutingConfig(prefill_policy="round_robin"))
    proxy = ServedProxy(fast_config(prefill_urls, decode_urls, **overrides)).__enter__()
    return proxy.wait_ready()


@pytest.fixture
def proxy(cluster):
    _, urls = cluster
    served = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], internal_token="s3cret")
    yield served
    served.__exit__(None, None, None)
