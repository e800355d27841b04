"""kv_aware routing through the real proxy over real HTTP, against stub workers whose caches the test sets:
the worker holding the prompt wins unless its queue costs more, cache-aware disaggregation skips the
prefill leg, predictions are checked against the workers' reports, restarts and gaps resync the index,
workers of different block sizes are each matched over their own, and /internal/routing/explain shows the
scores."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv.events import KVEventRecorder, KVSnapshot
from pdserve.kv.events_wire import decode_line, encode_snapshot
from proxy.backends import BackendPool, Role
from proxy.client_request import ClientRequest
from proxy.config import HealthConfig, RoutingConfig
from proxy.routing.kv_prompt import PromptHasher
from proxy.routing.candidates import Candidate, RoleTurns, RouteRequest
from proxy.routing.kv_routing import KVRouting
from proxy.routing.route import build_policy, pick_worker
from tests.kv.kv_stubs import BLOCK, KVStubWorker, stub_routing_info
from tests.proxy.proxy_stubs import Served, ServedProxy, fast_config
from tests.proxy.routing.test_kv_index import held_prefix

MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and politely."},
            {"role": "user", "content": "What is the capital of France? Tell me a joke about numbers 12345."}]
BODY = {"model": "stub-model", "messages": MESSAGES, "max_tokens": 4}
# 70 token ids: a prefix cached on a worker counts in its own blocks, 16 or 32 tokens (never the last token).
TOKENS = list(range(100, 170))


@dataclass
class SizedKVStubWorker(KVStubWorker):
    """A stub worker whose blocks hold `block_size` tokens: its snapshot says so, its held hashes chain them."""

    block_size: int = BLOCK

    async def _lines(self):
        lines = super()._lines()
        snapshot = decode_line(await anext(lines))
        yield encode_snapshot(self.epoch, KVSnapshot(snapshot.seq, tuple(snapshot.blocks)), self.block_size)
        async for line in lines:
            yield line


def sized_worker(role: str, block_size: int, num_computed: int, **fields) -> SizedKVStubWorker:
    """A worker that computed the first `num_computed` of TOKENS: it holds their full blocks of its size."""
    held = [block.block_hash for block in held_prefix(TOKENS, num_computed, block_size)]
    return SizedKVStubWorker(role, f"{role[0]}{block_size}", held=held, block_size=block_size, **fields)


@pytest.fixture(scope="module")
def prompt():
    """The test body's block hashes, computed as any proxy (and worker) would."""
    return asyncio.run(PromptHasher(stub_routing_info()).prompt_blocks("/v1/chat/completions", BODY))


def kv_config(prefill_urls, decode_urls, **routing):
    settings = dict(prefill_policy="kv_aware", decode_policy="kv_aware", **routing)
    # No test here takes a worker down: a health poll answered late (up to 5 s: four stub servers, the
    # proxy and the client share one interpreter on a busy CI machine) must not take a live worker
    # out of the pool and turn a request into a 503 (CI saw it once with fast_config's 0.5 s).
    health = HealthConfig(interval_s=0.05, timeout_s=5.0, breaker_cooldown_s=0.5)
    return fast_config(prefill_urls, decode_urls, routing=RoutingConfig(**settings), health=health)


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def index_synced(proxy: ServedProxy, *workers_and_urls) -> bool:
    index = proxy.components.kv.index
    return proxy.components.kv.hasher is not None and all(index.worker(url) is not None for url in workers_and_urls)


def chat(proxy: ServedProxy, body=BODY, **headers) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def test_prefill_goes_to_the_worker_that_holds_the_prompt_and_the_prediction_is_checked(prompt):
    cold = KVStubWorker("prefill", "p-cold")
    warm = KVStubWorker("prefill", "p-warm", held=list(prompt.block_hashes(BLOCK)[:3]), reported_cached_tokens=12)
    decode = KVStubWorker("decode", "d0")
    with Served(cold.app()) as c, Served(warm.app()) as w, Served(decode.app()) as d:
        with ServedProxy(kv_config([c.url, w.url], [d.url], kv_decode_only_max_tokens=0)) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, c.url, w.url, d.url))
            for _ in range(4):
                assert chat(proxy).status_code == 200
            assert len(warm.calls) == 4 and not cold.calls
            assert proxy.metric("pdserve_proxy_kv_routing_decisions_total", role="prefill", reason="cache_hit") == 4
            assert proxy.metric("pdserve_proxy_kv_predicted_cached_tokens_total", role="prefill") == 4 * 12
            assert proxy.metric("pdserve_proxy_kv_actual_cached_tokens_total", role="prefill") == 4 * 12
            assert proxy.metric("pdserve_proxy_kv_prediction_error_tokens_sum", role="prefill") == 0
            warm.reported_cached_tokens = 8  # the worker evicted a block the index did not hear of yet
            assert chat(proxy).status_code == 200
            assert proxy.metric("pdserve_proxy_kv_prediction_error_tokens_sum", role="prefill") == 4


def test_a_busy_worker_loses_to_an_idle_one_when_its_cached_prefix_is_short(prompt):
    idle = KVStubWorker("prefill", "p-idle")
    busy = KVStubWorker("prefill", "p-busy", held=list(prompt.block_hashes(BLOCK)[:1]))
    decode = KVStubWorker("decode", "d0")
    with Served(idle.app()) as i, Served(busy.app()) as b, Served(decode.app()) as d:
        with ServedProxy(kv_config([i.url, b.url], [d.url], kv_load_tokens=16, kv_decode_only_max_tokens=0)) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, i.url, b.url))
            proxy.components.prefill_pool.get(b.url).num_in_flight = 3  # 3 x 16 tokens outweigh 4 cached ones
            assert chat(proxy).status_code == 200
            assert idle.calls and not busy.calls
            assert proxy.metric("pdserve_proxy_kv_routing_decisions_total", role="prefill", reason="load") == 1
            proxy.components.prefill_pool.get(b.url).num_in_flight = 0


def test_without_routing_info_requests_are_served_by_load(prompt):
    workers = [KVStubWorker("prefill", "p0", serve_info=False), KVStubWorker("decode", "d0", serve_info=False)]
    with Served(workers[0].app()) as p, Served(workers[1].app()) as d:
        with ServedProxy(kv_config([p.url], [d.url])) as proxy:
            proxy.wait_ready()
            assert chat(proxy).status_code == 200
            assert proxy.metric("pdserve_proxy_kv_routing_decisions_total", reason="no_blocks") == 2


def test_a_decode_worker_holding_the_prompt_serves_it_without_a_prefill_leg(prompt):
    prefill = KVStubWorker("prefill", "p0")
    decode = KVStubWorker("decode", "d0", held=list(prompt.block_hashes(BLOCK)),
                          reported_cached_tokens=len(prompt.block_hashes(BLOCK)) * BLOCK)
    with Served(prefill.app()) as p, Served(decode.app()) as d:
        with ServedProxy(kv_config([p.url], [d.url], kv_decode_only_max_tokens=16)) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, p.url, d.url))
            answer = chat(proxy)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "from local"
            assert not prefill.calls and "kv_transfer_params" not in decode.calls[0].body
            assert proxy.metric("pdserve_proxy_kv_routing_decisions_total", role="prefill",
                                reason="skipped_decode_cached") == 1
            assert proxy.metric("pdserve_proxy_requests_total", mode="decode_only") == 1
            assert proxy.metric("pdserve_proxy_kv_prediction_error_tokens_sum", role="decode") == 0
            assert proxy.metric("pdserve_proxy_kv_actual_cached_tokens_total", role="decode") > 0


def test_a_restart_replaces_the_workers_blocks_and_a_lost_event_forces_a_resync(prompt):
    worker = KVStubWorker("prefill", "p0", held=list(prompt.block_hashes(BLOCK)[:2]))
    decode = KVStubWorker("decode", "d0")
    with Served(worker.app()) as p, Served(decode.app()) as d:
        with ServedProxy(kv_config([p.url], [d.url])) as proxy:
            proxy.wait_ready()
            index = proxy.components.kv.index
            wait_until(lambda: index.holders(prompt.block_hashes(BLOCK)[1]) == {p.url})
            worker.restart("e2", [prompt.block_hashes(BLOCK)[3]])
            wait_until(lambda: index.worker(p.url) is not None and index.worker(p.url).epoch == "e2")
            assert index.holders(prompt.block_hashes(BLOCK)[0]) == frozenset()
            assert index.holders(prompt.block_hashes(BLOCK)[3]) == {p.url}
            assert proxy.metric("pdserve_proxy_kv_resyncs_total", role="prefill", reason="restart") == 1
            recorder = KVEventRecorder()
            recorder.enabled = True
            hashes = prompt.block_hashes(BLOCK)
            recorder.stored(hashes[0], None, 0)
            recorder.stored(hashes[1], hashes[0], 0)
            worker.push_events(recorder.drain()[1:])  # event 1 never arrives
            wait_until(lambda: proxy.metric("pdserve_proxy_kv_resyncs_total", role="prefill", reason="gap") == 1)
            assert worker.num_streams >= 3


def test_explain_shows_each_candidates_score_and_needs_the_token(prompt):
    warm = KVStubWorker("prefill", "p-warm", held=list(prompt.block_hashes(BLOCK)[:2]))
    decode = KVStubWorker("decode", "d0")
    with Served(warm.app()) as w, Served(decode.app()) as d:
        config = kv_config([w.url], [d.url]).model_copy(update={"internal_token": "s3cret"})
        with ServedProxy(config) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, w.url, d.url))
            url = proxy.url + "/internal/routing/explain"
            assert httpx.post(url, json=BODY).status_code == 401
            answer = httpx.request("GET", url, json=BODY, headers={"X-Pdserve-Internal-Token": "s3cret"}).json()
            assert answer["num_prompt_tokens"] == prompt.num_tokens
            assert answer["prefill"]["candidates"] == [
                {"url": w.url, "cached_tokens": 8, "offload_tokens": 0, "load": 0.0, "score": prompt.num_tokens - 8,
                 "block_size": BLOCK}]
            assert answer["prefill"]["reason"] == "cache_hit" and answer["skip_prefill"] is False
            assert not warm.calls  # explaining routes nothing


def test_each_candidate_is_scored_over_its_own_block_size_and_explain_shows_it():
    """No network: one index, workers of 16- and 32-token blocks, a hasher from a worker of 4-token blocks."""
    workers = [(Role.PREFILL, "http://p16", 16, 48), (Role.PREFILL, "http://p32", 32, 64),
               (Role.DECODE, "http://d16", 16, 48), (Role.DECODE, "http://d32", 32, 48)]  # url, size, computed
    config = kv_config([w[1] for w in workers[:2]], [w[1] for w in workers[2:]], kv_decode_only_max_tokens=0)
    pools = {role: BackendPool(role, config, lambda url: httpx.AsyncClient(base_url=url)) for role in Role}
    routing = KVRouting(config.routing, pools, CollectorRegistry())
    routing.hasher = PromptHasher(stub_routing_info())
    for role, url, block_size, num_computed in workers:
        pools[role].add(url).healthy = True
        blocks = held_prefix(TOKENS, num_computed, block_size)
        routing.index.apply_snapshot(url, role.value, "e1", 0, block_size, blocks)
    request = ClientRequest("/v1/completions", {"prompt": TOKENS, "max_tokens": 1}, "r1", False, "", len(TOKENS))
    asyncio.run(routing.prepare(request))
    facts = RouteRequest(len(TOKENS), blocks_known=routing.blocks_known(request))
    policy = build_policy("kv_aware", config.routing)
    for role in Role:
        offered = [Candidate.of(b, routing.cached_prefix(b.url, request)) for b in pools[role].backends()]
        routing.record(role, request, pick_worker(policy, facts, offered, RoleTurns()))
    assert request.kv_route.predicted == {"http://p32": 64, "http://d16": 48}
    answer = asyncio.run(routing.explain(request.path, request.body))
    assert (answer["block_size"], answer["num_prompt_tokens"], answer["num_blocks"]) == (BLOCK, 70, 70 // BLOCK)
    assert [(c["url"], c["block_size"], c["cached_tokens"], c["score"]) for c in answer["prefill"]["candidates"]] == [
        ("http://p32", 32, 64, 6), ("http://p16", 16, 48, 22)]
    assert [(c["url"], c["block_size"], c["cached_tokens"], c["score"]) for c in answer["decode"]["candidates"]] == [
        ("http://d16", 16, 48, 22), ("http://d32", 32, 32, 38)]
    assert answer["prefill"]["reason"] == answer["decode"]["reason"] == "cache_hit"


def test_workers_of_different_block_sizes_are_each_routed_by_their_own_hits():
    """Over HTTP: each worker's snapshot names its block size, and the predictions match what each reports."""
    prefill = [sized_worker("prefill", 16, 48), sized_worker("prefill", 32, 64, reported_cached_tokens=64)]
    decode = [sized_worker("decode", 16, 48, reported_cached_tokens=48), sized_worker("decode", 32, 48)]
    body = {"model": "stub-model", "prompt": TOKENS, "max_tokens": 1}
    with Served(prefill[0].app()) as p16, Served(prefill[1].app()) as p32, \
            Served(decode[0].app()) as d16, Served(decode[1].app()) as d32:
        with ServedProxy(kv_config([p16.url, p32.url], [d16.url, d32.url], kv_decode_only_max_tokens=0)) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, p16.url, p32.url, d16.url, d32.url))
            index = proxy.components.kv.index
            assert [index.worker(u).block_size for u in (p16.url, p32.url, d16.url, d32.url)] == [16, 32, 16, 32]
            for _ in range(2):  # equal scores would alternate: every request going to one worker is the cache
                assert httpx.post(proxy.url + "/v1/completions", json=body, timeout=10).status_code == 200
            assert (len(prefill[0].calls), len(prefill[1].calls), len(decode[0].calls), len(decode[1].calls)) == (
                0, 2, 2, 0)
            for role, cached in (("prefill", 64), ("decode", 48)):
                assert proxy.metric("pdserve_proxy_kv_routing_decisions_total", role=role, reason="cache_hit") == 2
                assert proxy.metric("pdserve_proxy_kv_predicted_cached_tokens_total", role=role) == 2 * cached
                assert proxy.metric("pdserve_proxy_kv_prediction_error_tokens_sum", role=role) == 0


def test_a_device_hit_beats_a_tier_hit_which_beats_a_miss_and_events_move_a_prefix_into_the_tier(prompt):
    """Three prefill workers hold the prompt's first 12 tokens on the device, in the offload tier, nowhere;
    then the device worker's pool evicts them into its own tier (the events a worker sends for that)."""
    held = list(prompt.block_hashes(BLOCK)[:3])
    device = KVStubWorker("prefill", "p-device", held=held, reported_cached_tokens=12)
    tier = KVStubWorker("prefill", "p-tier", offloaded=held, reported_cached_tokens=12)
    cold = KVStubWorker("prefill", "p-cold")
    decode = KVStubWorker("decode", "d0")
    with Served(device.app()) as v, Served(tier.app()) as t, Served(cold.app()) as c, Served(decode.app()) as d:
        with ServedProxy(kv_config([v.url, t.url, c.url], [d.url], kv_decode_only_max_tokens=0)) as proxy:
            proxy.wait_ready()
            wait_until(lambda: index_synced(proxy, v.url, t.url, c.url, d.url))
            answer = asyncio.run(proxy.components.kv.explain("/v1/chat/completions", BODY))
            assert [(x["url"], x["cached_tokens"], x["offload_tokens"], x["score"])
                    for x in answer["prefill"]["candidates"]] == [
                (v.url, 12, 0, prompt.num_tokens - 12), (t.url, 12, 12, prompt.num_tokens - 6),
                (c.url, 0, 0, prompt.num_tokens)]
            assert chat(proxy).status_code == 200 and len(device.calls) == 1
            recorder = KVEventRecorder()
            recorder.enabled = True
            for block_hash in held:  # write-back: the tier takes each page, then the pool drops it
                recorder.stored(block_hash, None, 0, "cpu")
                recorder.removed(block_hash, 0)
            device.push_events(recorder.drain())
            index = proxy.components.kv.index
            wait_until(lambda: index.worker(v.url).last_seq == 6)
            scores = {x["url"]: (x["cached_tokens"], x["offload_tokens"]) for x in asyncio.run(
                proxy.components.kv.explain("/v1/chat/completions", BODY))["prefill"]["candidates"]}
            assert scores == {v.url: (12, 12), t.url: (12, 12), c.url: (0, 0)}
            assert proxy.metric("pdserve_proxy_kv_prediction_error_tokens_sum", role="prefill") == 0


def test_explain_says_when_kv_aware_routing_is_off():
    decode = KVStubWorker("decode", "d0")
    with Served(decode.app()) as d:
        with ServedProxy(fast_config([], [d.url])) as proxy:
            assert httpx.post(proxy.url + "/internal/routing/explain", json=BODY).status_code == 404


def test_kv_aware_routing_serves_where_torch_and_nixl_cannot_be_imported():
    from tests.test_proxy_imports import outside_the_rule, run_blocked

    result = run_blocked(("torch", "nixl"), """
        import asyncio, time
        import httpx
        from proxy.config import RoutingConfig
        from proxy.routing.kv_prompt import PromptHasher
        from tests.kv.kv_stubs import KVStubWorker, stub_routing_info
        from tests.proxy.proxy_stubs import Served, ServedProxy, fast_config

        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 2}
        blocks = asyncio.run(PromptHasher(stub_routing_info()).prompt_blocks("/v1/chat/completions", body))
        cold, warm = KVStubWorker("prefill", "cold"), KVStubWorker("prefill", "warm", held=list(blocks.block_hashes(4)))
        with Served(cold.app()) as c, Served(warm.app()) as w, Served(KVStubWorker("decode", "d").app()) as d:
            config = fast_config([c.url, w.url], [d.url], routing=RoutingConfig(prefill_policy="kv_aware"))
            with ServedProxy(config) as proxy:
                proxy.wait_ready()
                deadline = time.monotonic() + 10
                while proxy.components.kv.hasher is None or proxy.components.kv.index.worker(w.url) is None:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                print(httpx.post(proxy.url + "/v1/chat/completions", json=body).json()["choices"][0]["text"])
        print(len(warm.calls), len(cold.calls))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nixl")))
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "pdserve")))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["from warm", "1 0", "[]"]
    assert outside_the_rule(set(lines[3].split(","))) == []
