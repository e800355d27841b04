"""Property-based fuzzing of the OpenAI bodies against real engines (tiny Qwen3) behind their real apps:
a colocated worker, and a prefill and a decode worker wired with the fake transport. Whatever the body,
no answer is a 5xx, no engine thread dies, and once the dust settles every block and request id is back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.transfer.fake_transport import FakeFabric
from tests.engine.inprocess import DECODE_REQUEST, InProcessWorker, metric_value, start_worker
from tests.tiny_models import QWEN_VOCAB, make_tiny_qwen3

MAX_MODEL_LEN = 64
LEASE_S = 1.0
TEMPLATE_PROMPT = list(range(10, 40))
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

# ---------------------------------------------------------------- strategies

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


token_ids = st.lists(st.integers(0, QWEN_VOCAB - 1), min_size=1, max_size=40)
prompt_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)
stop_strings = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)
# Values the API accepts, edge cases included; `mutated` then breaks one or two fields of a body.
VALID_FIELDS: dict[str, st.SearchStrategy] = {
    "max_tokens": st.integers(1, 5),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from([1e-300, 5e-324, 2.0, 0.0])),
    "top_p": st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1.0])),
    "top_k": st.one_of(st.integers(-1, 400), st.just(2**80)),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(stop_strings, st.lists(stop_strings, max_size=16)),
    "stop_token_ids": st.lists(st.integers(0, QWEN_VOCAB - 1), max_size=64),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "n": st.integers(1, 2),
    "user": st.text(max_size=10),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True),
    "logit_bias": st.dictionaries(st.integers(0, QWEN_VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=4),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
COMPLETION_FIELDS = {**VALID_FIELDS, "logprobs": st.one_of(st.none(), st.integers(0, 5)), "echo": st.booleans()}
CHAT_FIELDS = {**VALID_FIELDS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
MUTABLE = [*VALID_FIELDS, "stream", "stream_options", "logprobs", "model", "max_completion_tokens", "logit_bias",
           "tools", "response_format", "echo", "best_of", "suffix", "x_unknown_field"]


def with_streaming(body: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(body, st.booleans(), st.booleans()).map(
        lambda t: {**t[0], "stream": True, "stream_options": {"include_usage": t[2]}} if t[1] else t[0])


def mutated(body: st.SearchStrategy) -> st.SearchStrategy:
    """A valid body with one or two fields (the prompt or messages included) replaced by anything."""
    def replace(pair):
        base, changes = pair
        return {**base, **dict(changes)}

    fields = st.sampled_from(MUTABLE + ["prompt", "messages"])
    return st.tuples(body, st.lists(st.tuples(fields, json_values), min_size=1, max_size=2)).map(replace)


completion_valid = with_streaming(st.fixed_dictionaries(
    {"prompt": st.one_of(prompt_text, token_ids, st.lists(token_ids, min_size=1, max_size=2),
                         st.lists(prompt_text, min_size=1, max_size=2))},
    optional=COMPLETION_FIELDS))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(prompt_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text}),
                                                min_size=1, max_size=2))})
chat_valid = with_streaming(st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)}, optional=CHAT_FIELDS))
completion_bodies = st.one_of(completion_valid, completion_valid, mutated(completion_valid))
chat_bodies = st.one_of(chat_valid, chat_valid, mutated(chat_valid))


def remote_params(template: dict[str, Any]) -> st.SearchStrategy:
    """A decode leg's kv_transfer_params: real ones from the prefill worker, a field or two replaced."""
    fields = st.sampled_from(sorted(template))
    replacement = st.one_of(json_values, st.sampled_from(
        ["127.0.0.1:1/x?y", "[::1]", "evil.example", "0" * 300, -1, 2**70, [[1, 2]], [[10**9]], [[0]]]))
    return st.lists(st.tuples(fields, replacement), min_size=1, max_size=2).map(
        lambda changes: {**template, **dict(changes)})


# ---------------------------------------------------------------- the workers


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    fabric = FakeFabric()
    colocated = start_worker("colocated", directory, fabric, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    prefill = start_worker("prefill", directory, fabric, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                           transfer={"lease_s": LEASE_S})
    decode = start_worker("decode", directory, fabric, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                          prefill_app=prefill.app, transfer={"lease_s": 4.0, "heartbeat_s": 0.5,
                                                             "pull_timeout_s": 1.0})
    everyone = {"colocated": colocated, "prefill": prefill, "decode": decode}
    yield everyone
    for worker in everyone.values():
        worker.close()


async def post(worker: InProcessWorker, path: str, body: Any) -> tuple[int, str]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with worker.client() as client:
        async with client.stream("POST", path, content=content,
                                 headers={"content-type": "application/json"}) as response:
            text = (await response.aread()).decode(errors="replace")
    return response.status_code, text


def check(worker: InProcessWorker, path: str, body: Any) -> tuple[int, str]:
    status, text = asyncio.run(post(worker, path, body))
    assert status < 500, f"{status} for {body!r}: {text[:500]}"
    assert "internal_error" not in text and "request_failed" not in text, f"{body!r}: {text[:500]}"
    assert worker.built.engine.is_alive(), "the engine thread died"
    return status, text


def settled(worker: InProcessWorker) -> bool:
    load = worker.built.engine.load_report()
    return (load.kv_usage == 0 and load.num_pinned_blocks == 0 and not (load.num_running or load.num_waiting
            or load.num_waiting_for_kv) and len(worker.built.engine.request_ids) == 0)


def assert_settles(*workers: InProcessWorker, timeout_s: float = LEASE_S + 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(settled(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for worker in workers:
        assert settled(worker), worker.built.engine.load_report()
        worker.built.kv_manager.check_invariants()


# ---------------------------------------------------------------- the properties


@SETTINGS
@given(body=completion_bodies)
def test_completion_bodies_never_get_a_5xx(workers, body):
    check(workers["colocated"], "/v1/completions", body)


@SETTINGS
@given(body=chat_bodies)
def test_chat_bodies_never_get_a_5xx(workers, body):
    check(workers["colocated"], "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.one_of(st.binary(max_size=200), st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
                     st.integers(1, 3000).map(lambda n: b'{"prompt": "x", "user": ' + b"{\"a\":" * n + b"1"
                                              + b"}" * n + b"}"),
                     st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_raw_bytes_never_get_a_5xx(workers, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert check(workers["colocated"], path, raw)[0] in (400, 413, 422) or raw.strip().startswith(b"{")


@SETTINGS
@given(body=completion_bodies, params=st.one_of(
    st.just(DECODE_REQUEST), json_values,
    st.fixed_dictionaries({"do_remote_decode": st.just(True)},
                          optional={"decode_max_tokens": json_values | st.integers(-1, 100),
                                    "decode_min_tokens": json_values | st.integers(-1, 100)})))
def test_prefill_legs_never_get_a_5xx(workers, body, params):
    prefill = workers["prefill"]
    status, text = check(prefill, "/v1/completions", {**body, "kv_transfer_params": params})
    answer = json.loads(text) if status == 200 and not body.get("stream") else {}
    pinned = answer.get("kv_transfer_params")
    if pinned:  # as the proxy would once no decode leg follows: the pinned-blocks limit is not what is fuzzed
        release = {key: pinned[key]
                   for key in ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")}
        assert asyncio.run(post(prefill, "/internal/kv/release", release))[0] == 202


@pytest.fixture(scope="module")
def template_params(workers) -> dict[str, Any]:
    # The streamed prefill legs fuzzed before keep their pins until the lease ends (no decode leg, and
    # no release: a stream's params are not read there). Wait those out, or a fast machine finds P's
    # pinned-blocks limit reached (503) when it pins the template.
    assert_settles(workers["prefill"])
    body = {"prompt": TEMPLATE_PROMPT, "max_tokens": 1, "kv_transfer_params": DECODE_REQUEST}
    status, text = asyncio.run(post(workers["prefill"], "/v1/completions", body))
    assert status == 200, text
    return json.loads(text)["kv_transfer_params"]


def test_decode_legs_never_get_a_5xx(workers, template_params):
    @SETTINGS
    @given(params=st.one_of(st.just(template_params), st.just(template_params), remote_params(template_params)),
           body=completion_valid)
    def decode_leg(params, body):
        check(workers["decode"], "/v1/completions", {**body, "prompt": TEMPLATE_PROMPT, "kv_transfer_params": params})

    decode_leg()


def test_after_the_fuzzing_everything_is_back(workers):
    """Runs last in this module: every block, pin and request id is back, and a request still works."""
    assert_settles(*workers.values())
    for worker in workers.values():
        status, text = check(worker, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert status == 200, text
    # The fuzz reached both sides of the validation: many requests were refused, many were served.
    # On the decode worker the split moves with timing (1 s leases; a forged host that cannot be
    # reached is served by a local prefill under `recompute`, not refused): 15 to 39 refusals of
    # about 85 legs were seen, hence the lower floor there.
    for name, worker in workers.items():
        served = metric_value(worker.metrics, "pdserve_request_finished_total")
        refused = metric_value(worker.metrics, "pdserve_request_errors_total")
        print(f"{name}: {served:.0f} requests ended in the engine, {refused:.0f} refused")
        assert served >= 20 and refused >= (8 if name == "decode" else 20), name
