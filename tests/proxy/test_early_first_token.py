"""The early first token (proxy/early_stream.py): P's token-1 events reach the client before D answers,
D's same events are taken off its stream (checked), and a failure after token 1 ends the stream with
an error event, never silently nor with a stream that begins with another token 1."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from proxy.early_stream import FirstEventsMismatch, HeadStrip
from tests.proxy.forwarder_fixtures import BODY, cluster, start_proxy, stubs  # noqa: F401

STREAMED = {**BODY, "stream": True}
# The stub decode worker's first event for a pin of p0 (tests/proxy/proxy_stubs.py `_events`).
P0_FIRST = 'data: {"choices": [{"index": 0, "text": "p0-0", "finish_reason": null}]}\n\n'


def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def texts(lines: list[str]) -> list[str]:
    return [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {\"choices")]


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# ---- the head strip, alone ------------------------------------------------------------------------

ROLE = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 100, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
TOKEN_1 = {**ROLE, "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": [
    {"token": "Hi", "logprob": -0.25}]}, "finish_reason": None}]}
TOKEN_2 = {**ROLE, "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]}


def fed_byte_by_byte(strip: HeadStrip, data: bytes) -> bytes:
    return b"".join(strip.feed(data[i:i + 1]) for i in range(len(data))) + strip.rest()


def test_the_strip_takes_p_events_off_d_head_across_any_chunking_and_passes_the_rest():
    early = sse(ROLE) + sse(TOKEN_1)
    d_stream = early + sse(TOKEN_2) + b"data: [DONE]\n\n"
    assert fed_byte_by_byte(HeadStrip(early), d_stream) == sse(TOKEN_2) + b"data: [DONE]\n\n"
    strip = HeadStrip(early)
    assert strip.feed(d_stream) == sse(TOKEN_2) + b"data: [DONE]\n\n" and not strip.stripping


def test_d_other_identity_is_rewritten_to_p_and_logprob_values_may_differ():
    early = sse(ROLE) + sse(TOKEN_1)
    d_token_1 = json.loads(json.dumps(TOKEN_1))
    d_token_1["choices"][0]["logprobs"]["content"][0]["logprob"] = -0.2500001  # D's batch, P's token
    other = {"id": "chatcmpl-b", "created": 101}
    d_stream = (sse({**ROLE, **other}) + sse({**d_token_1, **other}) + sse({**TOKEN_2, **other})
                + sse({**ROLE, **other, "choices": [], "usage": {"completion_tokens": 2}}) + b"data: [DONE]\n\n")
    out = fed_byte_by_byte(HeadStrip(early), d_stream)
    assert out == sse(TOKEN_2) + sse({**ROLE, "choices": [], "usage": {"completion_tokens": 2}}) + b"data: [DONE]\n\n"


def test_a_different_token_1_is_a_mismatch_and_d_error_event_passes():
    early = sse(ROLE) + sse(TOKEN_1)
    other_token = {**TOKEN_1, "choices": [{**TOKEN_1["choices"][0], "delta": {"content": "Ho"}}]}
    with pytest.raises(FirstEventsMismatch):
        HeadStrip(early).feed(sse(ROLE) + sse(other_token))
    error = sse({"error": {"message": "engine failed", "type": "internal_error", "code": 500}})
    strip = HeadStrip(early)
    assert strip.feed(sse(ROLE) + error + b"data: [DONE]\n\n") == error + b"data: [DONE]\n\n"


# ---- through the proxy, with stub workers --------------------------------------------------------

@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent_legs", "legs_in_turn"])
def test_client_gets_p_token_1_while_d_is_held_and_d_stream_follows_without_it(cluster, concurrent):
    workers, urls = cluster
    workers["p0"].first_events = P0_FIRST
    workers["d0"].hold = threading.Event()  # D answers nothing until the client has token 1
    proxy = start_proxy([urls["p0"]], [urls["d0"]], concurrent_legs=concurrent)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            head = next(line for line in lines if line)  # a read timeout here: the proxy waited for D
            workers["d0"].hold.set()
            rest = [line for line in lines if line]
        assert texts([head]) == ["p0-0"] and texts(rest) == ["p0-1", "p0-2"] and rest[-1] == "data: [DONE]"
        assert workers["p0"].calls[0].body["kv_transfer_params"]["want_first_events"] is True
        assert "first_events" not in workers["d0"].calls[0].body["kv_transfer_params"]  # for the client only
        assert proxy.metric("pdserve_proxy_early_first_token_total", outcome="sent", reason="") == 1
        assert proxy.metric("pdserve_proxy_ttft_seconds_count", mode="disaggregated") == 1
    finally:
        proxy.__exit__(None, None, None)


@pytest.mark.parametrize("early_on, offered", [(False, None), (True, None)], ids=["flag_off", "p_declined"])
def test_without_p_events_the_stream_is_d_bytes_unchanged(cluster, early_on, offered):
    workers, urls = cluster
    workers["p0"].first_events = offered
    proxy = start_proxy([urls["p0"]], [urls["d0"]], early_first_token=early_on)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10) as response:
            lines = [line for line in response.iter_lines() if line]
        assert texts(lines) == ["p0-0", "p0-1", "p0-2"]
        asked = workers["p0"].calls[0].body["kv_transfer_params"].get("want_first_events", False)
        assert asked is early_on
        assert proxy.metric("pdserve_proxy_early_first_token_total", outcome="not_offered",
                            reason="unnamed") == (1 if early_on else 0)  # the stub P names no reason
    finally:
        proxy.__exit__(None, None, None)


def _error_ended(lines: list[str]) -> str:
    assert lines[-1].startswith('data: {"error"'), lines
    return json.loads(lines[-1][6:])["error"]["message"]


def test_d_beginning_otherwise_ends_the_stream_with_an_error_event(cluster):
    workers, urls = cluster
    workers["p0"].first_events = P0_FIRST.replace("p0-0", "another token")
    proxy = start_proxy([urls["p0"]], [urls["d0"]])
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10) as response:
            lines = [line for line in response.iter_lines() if line]
        assert texts(lines) == ["another token"]
        assert "differs" in _error_ended(lines)
        assert proxy.metric("pdserve_proxy_early_first_token_total", outcome="mismatch", reason="") == 1
    finally:
        proxy.__exit__(None, None, None)


def test_a_decode_failure_after_token_1_ends_the_stream_with_an_error_event(cluster):
    workers, urls = cluster
    workers["p0"].first_events = P0_FIRST
    workers["d0"].fail_status = 500  # D's own answer about the request: not retried, as without the early token
    proxy = start_proxy([urls["p0"]], [urls["d0"]], concurrent_legs=False)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10) as response:
            assert response.status_code == 200  # it went out with token 1
            lines = [line for line in response.iter_lines() if line]
        assert texts(lines) == ["p0-0"]
        _error_ended(lines)
        assert proxy.metric("pdserve_proxy_early_first_token_total", outcome="decode_failed", reason="") == 1
    finally:
        proxy.__exit__(None, None, None)


def first_event_of(engine: str) -> str:
    """The stub decode worker's first event for a pin of `engine`."""
    return P0_FIRST.replace("p0-0", f"{engine}-0")


@pytest.mark.parametrize("same_token", [True, False], ids=["greedy_or_seeded", "sampled_again"])
def test_after_token_1_a_kv_retry_prefills_again_and_its_stream_must_begin_with_that_token(cluster, same_token):
    workers, urls = cluster
    # D cannot read the first P's KV: leg 1 again on the other P, whose pin D then reads and whose name
    # the stub D streams ("<P>-i"). Each P's events name the token the retried stream will begin with
    # (a greedy or seeded token 1, drawn again alike), or their own (a sampled one, drawn otherwise).
    workers["p0"].first_events = first_event_of("p0" if not same_token else "p1")
    workers["p1"].first_events = first_event_of("p1" if not same_token else "p0")
    workers["d0"].num_kv_failures = 1
    proxy = start_proxy([urls["p0"], urls["p1"]], [urls["d0"]], concurrent_legs=False)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10) as response:
            lines = [line for line in response.iter_lines() if line]
        assert len(workers["p0"].calls) == len(workers["p1"].calls) == 1  # prefilled again, as without it
        second = workers["d0"].calls[-1].body["kv_transfer_params"]["remote_engine_id"]  # the retry's P
        assert len(workers["d0"].calls) == 2 and second in ("p0", "p1")
        if same_token:
            assert texts(lines) == [f"{second}-0", f"{second}-1", f"{second}-2"] and lines[-1] == "data: [DONE]"
        else:
            assert len(texts(lines)) == 1 and "differs" in _error_ended(lines)
            assert proxy.metric("pdserve_proxy_early_first_token_total", outcome="mismatch", reason="") == 1
    finally:
        proxy.__exit__(None, None, None)


@pytest.mark.parametrize("when", ["before_d_answers", "mid_stream"])
def test_a_client_gone_after_token_1_cancels_the_decode_leg(cluster, when):
    workers, urls = cluster
    workers["p0"].first_events = P0_FIRST
    workers["d0"].num_chunks, workers["d0"].chunk_delay_s = 50, 0.05
    if when == "before_d_answers":
        workers["d0"].delay_s = 30  # D answers nothing before the client leaves (it notices the hang-up)
    proxy = start_proxy([urls["p0"]], [urls["d0"]], concurrent_legs=False)
    try:
        with httpx.stream("POST", proxy.url + "/v1/completions", json=STREAMED, timeout=10,
                          headers={"X-Request-Id": "gone-early"}) as response:
            lines = response.iter_lines()
            assert texts([next(line for line in lines if line)]) == ["p0-0"]  # P's token 1
            if when == "mid_stream":
                assert texts([next(line for line in lines if line)]) == ["p0-1"]  # D's stream, token 1 stripped
        assert wait_until(lambda: workers["d0"].disconnects == ["gone-early"])  # D aborts what nobody reads
        decode = proxy.components.decode_pool.get(urls["d0"])
        assert wait_until(lambda: decode.num_in_flight == 0)
    finally:
        proxy.__exit__(None, None, None)
