"""What the adaptive disaggregation's speeds learn from a leg: the tokens the worker computed, never the
cached part of its prompt (issue 36, item 8). The legs are faked; the forwarder is the real one."""

from __future__ import annotations

import asyncio
import json

from proxy.app import build_components
from proxy.backends import Role
from proxy.client_request import parse_client_request
from proxy.legs import OpenLeg, PrefillAnswer
from proxy.routing.kv_prompt import KVRoute, PromptBlocks
from tests.proxy.proxy_stubs import fast_config


class RecordedSpeed:
    def __init__(self) -> None:
        self.samples: list[int] = []
        self.s_per_token = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.samples.append(num_tokens)


class FakeSender:
    def __init__(self, num_cached_tokens):
        self.num_cached_tokens = num_cached_tokens

    async def prefill(self, backend, request):
        return PrefillAnswer({"remote_engine_id": "p"}, self.num_cached_tokens)

    async def open_decode(self, backend, request, params, extra_headers=None):
        return OpenLeg(backend, None, started_s=1.0, headers_s=1.5)  # type: ignore[arg-type]


def forwarder_with(sender, role: Role):
    components = build_components(fast_config(["http://p:1"], ["http://d:1"]))
    forwarder = components.forwarder
    forwarder._sender = sender
    recorded = forwarder._speeds[role] = RecordedSpeed()
    pool = components.prefill_pool if role is Role.PREFILL else components.decode_pool
    return forwarder, pool.backends()[0], recorded


def token_request(num_tokens: int, stream: bool = False):
    body = {"model": "m", "prompt": [7] * num_tokens, "max_tokens": 4, "stream": stream}
    return parse_client_request("/v1/completions", json.dumps(body).encode(), "rid", 4.0)


def test_a_prefill_leg_teaches_the_speed_of_the_tokens_it_computed_not_of_its_cached_prefix():
    forwarder, backend, recorded = forwarder_with(FakeSender(num_cached_tokens=900), Role.PREFILL)
    asyncio.run(forwarder._timed_prefill(backend, token_request(1000)))
    assert recorded.samples == [100]


def test_a_prefill_leg_that_was_all_cached_teaches_nothing():
    forwarder, backend, recorded = forwarder_with(FakeSender(num_cached_tokens=1000), Role.PREFILL)
    asyncio.run(forwarder._timed_prefill(backend, token_request(1000)))
    assert recorded.samples == []


def test_a_decode_only_leg_learns_from_the_uncached_part_the_index_predicted_and_not_without_it():
    forwarder, backend, recorded = forwarder_with(FakeSender(None), Role.DECODE)
    request = token_request(1000, stream=True)
    asyncio.run(forwarder._open_decode(backend, request, None, None))
    assert recorded.samples == []  # D's cached prefix unknown: no figure to learn from
    request.kv_route = KVRoute(None)
    request.kv_route.predicted[backend.url] = 600
    asyncio.run(forwarder._open_decode(backend, request, None, None))
    assert recorded.samples == [400]


def test_a_text_prompt_is_counted_by_the_tokenizer_where_the_proxy_has_it():
    """The estimate (characters / 4) says 250 tokens for this text; the tokenizer's count (the prompt's
    blocks, as kv_aware routing computed them) is what the sample uses."""
    forwarder, backend, recorded = forwarder_with(FakeSender(num_cached_tokens=16), Role.PREFILL)
    body = {"model": "m", "prompt": "x" * 1000, "max_tokens": 4}
    request = parse_client_request("/v1/completions", json.dumps(body).encode(), "rid", 4.0)
    assert request.num_prompt_tokens == 250
    request.kv_route = KVRoute(PromptBlocks(tuple(range(64))))
    asyncio.run(forwarder._timed_prefill(backend, request))
    assert recorded.samples == [64 - 16]
