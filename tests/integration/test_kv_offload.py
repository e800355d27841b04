"""The offload tier with real processes and real HTTP on a tiny random Qwen3: a pool of 40 blocks
fed more distinct prompts than it holds, then the same prompts again. Without a tier the second
pass recomputes nearly everything; with either tier (host memory, files) it recomputes at most a
quarter, and every greedy answer equals the no-tier run's. The same through P/D with the tier on
the prefill worker, and with the tier on the decode worker (its prefix comes from its own tier and
only the rest is pulled). A tensor-parallel worker's tier, in host memory and in files: rank 0
decides, each rank copies its own slice (into its own file), and the second pass answers as the first. A kv_aware proxy following the tiered worker's KV events predicts a prefix held
only in its tier as cached tokens to load from the tier, exactly the hit the worker then reports."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster import ProxyProcess, Worker, free_port, start_workers, stop_all, two_legs, wait_for
from tests.tiny_models import QWEN_VOCAB, make_tiny_qwen3, random_prompt

pytestmark = pytest.mark.slow

COMPUTED = "pdserve_engine_computed_prompt_tokens_total"
PROMPTS = [random_prompt(40, QWEN_VOCAB, 300 + seed) for seed in range(10)]  # 100 blocks of 4 tokens
TOTAL = sum(len(prompt) for prompt in PROMPTS)
DECODE_PROMPTS = [random_prompt(40, QWEN_VOCAB, 400 + seed) for seed in range(10)]  # for the tiered decode worker


@pytest.fixture(scope="module")
def workers(tmp_path_factory, device):
    model_dir = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(model_dir)
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", model_dir, "--block-size", "4", "--num-blocks", "41"]
    tier = ["--kv-offload-bytes", "64MiB"]
    plain = Worker("serve", free_port(), str(logs / "plain.log"), common, device)
    tiered = Worker("serve", free_port(), str(logs / "tiered.log"), [*common, *tier], device)
    offload_dir = tmp_path_factory.mktemp("offload")
    filed = Worker("serve", free_port(), str(logs / "filed.log"), [*common, *tier, "--kv-offload-dir", str(offload_dir)],
                   device)
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), [*common, *tier], device)
    # No prefix cache on D: every answer pulls the whole prompt from P, the second time pages P loaded from its tier.
    decode = Worker("decode", free_port(), str(logs / "decode.log"),
                    [*common[:4], "--num-blocks", "200", "--no-prefix-caching"], device)
    tiered_decode = Worker("decode", free_port(), str(logs / "tiered-decode.log"), [*common, *tier], device)
    started = start_workers(plain, tiered, filed, prefill, decode, tiered_decode)
    yield plain, tiered, (filed, offload_dir), prefill, decode, tiered_decode
    stop_all(*started)


def body(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def model_of(worker: Worker) -> str:
    return httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def complete_twice(worker: Worker) -> tuple[list[str], list[str], float]:
    """Every prompt once then again, one at a time: (answers, answers, prompt tokens computed in the second pass)."""
    model = model_of(worker)

    def one_pass() -> list[str]:
        answers = []
        for prompt in PROMPTS:
            response = httpx.post(worker.url + "/v1/completions", json=body(model, prompt), timeout=120)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
        return answers

    first = one_pass()
    before = worker.metric(COMPUTED)
    second = one_pass()
    return first, second, worker.metric(COMPUTED) - before


def test_a_second_pass_comes_from_the_tier_with_the_same_answers(workers):
    plain, tiered, *_ = workers
    plain_first, plain_second, plain_recomputed = complete_twice(plain)
    tier_first, tier_second, tier_recomputed = complete_twice(tiered)
    print(f"second pass recomputed {plain_recomputed:.0f}/{TOTAL} without a tier, {tier_recomputed:.0f}/{TOTAL} with one")
    assert plain_recomputed >= 0.9 * TOTAL
    assert tier_recomputed <= 0.25 * TOTAL
    assert tier_first == tier_second == plain_first == plain_second
    assert tiered.metric("pdserve_kv_offload_bytes_total") > 0
    assert tiered.metric("pdserve_kv_offload_failed_loads_total") == 0
    assert 0 < tiered.metric("pdserve_kv_offload_usage_ratio") <= 1


def test_the_file_tier_writes_files_and_serves_the_second_pass(workers):
    plain, _, (filed, offload_dir), *_ = workers
    plain_first = [httpx.post(plain.url + "/v1/completions", json=body(model_of(plain), p), timeout=120)
                   .json()["choices"][0]["text"] for p in PROMPTS]
    first, second, recomputed = complete_twice(filed)
    print(f"file tier: second pass recomputed {recomputed:.0f}/{TOTAL}")
    assert recomputed <= 0.25 * TOTAL
    assert first == second == plain_first
    assert (offload_dir / "pages.bin").stat().st_size > 0
    assert filed.metric("pdserve_kv_offload_failed_loads_total") == 0


def test_pd_with_the_tier_on_the_prefill_worker(workers):
    _, _, _, prefill, decode, _ = workers
    model = model_of(prefill)
    passes = []
    for round_ in range(2):
        before = prefill.metric(COMPUTED)
        answers = []
        for index, prompt in enumerate(PROMPTS):
            _, response = two_legs(prefill, decode, "/v1/completions", body(model, prompt), f"pd-{round_}-{index}")
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
        passes.append((answers, prefill.metric(COMPUTED) - before))
    print(f"P/D: prefill computed {passes[0][1]:.0f} then {passes[1][1]:.0f} of {TOTAL} prompt tokens")
    # The first pass has no hit at all (distinct prompts): it is the no-tier run.
    assert passes[0][0] == passes[1][0]
    assert passes[0][1] >= 0.9 * TOTAL
    assert passes[1][1] <= 0.25 * TOTAL


def test_pd_with_the_tier_on_the_decode_worker_pulls_only_what_its_tier_lacks(workers):
    plain, _, _, prefill, _, decode = workers
    model = model_of(prefill)
    expected = [httpx.post(plain.url + "/v1/completions", json=body(model, p), timeout=120)
                .json()["choices"][0]["text"] for p in DECODE_PROMPTS]
    passes = []
    for round_ in range(2):
        pulled, from_tier = decode.metric("pdserve_transfer_bytes_total"), offload_hit_tokens(decode)
        answers = []
        for index, prompt in enumerate(DECODE_PROMPTS):
            _, response = two_legs(prefill, decode, "/v1/completions", body(model, prompt), f"pd-tiered-d-{round_}-{index}")
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
        passes.append((answers, decode.metric("pdserve_transfer_bytes_total") - pulled,
                       offload_hit_tokens(decode) - from_tier))
    (first, first_pulled, first_hits), (second, second_pulled, second_hits) = passes
    print(f"P/D, tier on D: D pulled {first_pulled:.0f} then {second_pulled:.0f} bytes; "
          f"{second_hits:.0f} prompt tokens from its tier the second time")
    assert first == second == expected
    assert first_hits == 0 and first_pulled > 0
    # 100 blocks through a pool of 40: most prefixes come back from D's tier, only the rest is pulled.
    assert second_hits >= 0.5 * sum(len(prompt) for prompt in DECODE_PROMPTS)
    assert second_pulled <= 0.5 * first_pulled
    assert decode.metric("pdserve_kv_offload_failed_loads_total") == 0


@pytest.fixture(scope="module", params=["host", "file"])
def tp_tiered(request, tmp_path_factory, device):
    model_dir = str(tmp_path_factory.mktemp("qwen3-tp"))
    make_tiny_qwen3(model_dir)
    logs = tmp_path_factory.mktemp("tp-logs")
    offload_dir = tmp_path_factory.mktemp("tp-offload")
    on_files = ["--kv-offload-dir", str(offload_dir)] if request.param == "file" else []
    worker = Worker("serve", free_port(), str(logs / f"tp-{request.param}.log"),
                    ["--model", model_dir, "--block-size", "4", "--num-blocks", "41", "--kv-offload-bytes", "64MiB",
                     "-tp", "2", *on_files], device)
    (started,) = start_workers(worker)
    yield started, request.param, offload_dir
    started.stop()


def test_a_tensor_parallel_worker_loads_every_rank_slice_from_its_tier(tp_tiered):
    worker, medium, offload_dir = tp_tiered
    first, second, recomputed = complete_twice(worker)
    print(f"TP=2 with a {medium} tier: second pass recomputed {recomputed:.0f}/{TOTAL}")
    # The first pass has no hit (distinct prompts): it is the no-tier run. A rank that did not load its
    # slice of a page would attend over stale KV there and answer differently.
    assert first == second
    assert recomputed <= 0.25 * TOTAL
    assert offload_hit_tokens(worker) >= 0.5 * TOTAL
    assert worker.metric("pdserve_kv_offload_failed_loads_total") == 0
    if medium == "file":  # each rank wrote its own slice's pages into its own file
        rank_files = [offload_dir / "pages.bin", offload_dir / "rank-1" / "pages.bin"]
        assert all(path.stat().st_size > 0 for path in rank_files)


def offload_hit_tokens(worker: Worker) -> float:
    """Prompt tokens the worker's prefix cache found from a block loaded from its tier on."""
    sample = 'pdserve_kv_prefix_cache_hits_by_medium_tokens_total{medium="offload"} '
    lines = httpx.get(worker.url + "/metrics", timeout=5).text.splitlines()
    return sum(float(line[len(sample):]) for line in lines if line.startswith(sample))


def test_a_kv_aware_proxy_sees_a_prefix_in_the_tier_and_predicts_the_hit_the_worker_reports(workers, tmp_path):
    _, tiered, *_ = workers
    model = model_of(tiered)
    for prompt in PROMPTS:  # 100 blocks through a pool of 40: the first prompts' pages end up in the tier only
        assert httpx.post(tiered.url + "/v1/completions", json=body(model, prompt), timeout=120).status_code == 200
    proxy = ProxyProcess(free_port(), str(tmp_path / "proxy.log"),
                         ["--decode", tiered.url, "--policy", "kv_aware", "--health-interval-s", "0.2"])
    try:
        def first_prompt_candidate() -> dict:
            try:
                answer = httpx.post(proxy.url + "/internal/routing/explain", json=body(model, PROMPTS[0]),
                                    timeout=10).json()
            except httpx.HTTPError:
                return {}
            candidates = answer.get("decode", {}).get("candidates", []) if answer.get("ready") else []
            return candidates[0] if candidates else {}

        assert wait_for(lambda: first_prompt_candidate().get("offload_tokens", 0) > 0, timeout_s=60), \
            f"the proxy never saw the tier's pages: {first_prompt_candidate()}"
        predicted = first_prompt_candidate()
        assert predicted["cached_tokens"] == predicted["offload_tokens"] == 36  # 9 blocks of 4: never the last token
        before = offload_hit_tokens(tiered)
        response = httpx.post(tiered.url + "/v1/completions", json=body(model, PROMPTS[0]), timeout=120)
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted["cached_tokens"]
        assert offload_hit_tokens(tiered) - before == predicted["offload_tokens"]
    finally:
        proxy.stop()
