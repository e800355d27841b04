"""The one stream reader (bench/lib/stream.py) and the drivers over it: one record per request with its
text, chunk times, usage and error, for streamed and whole answers, and failures recorded, not raised."""

from __future__ import annotations

import json

import httpx

from bench.lib.load import Call, run_open_loop
from bench.lib.stream import RequestRecord, read_lines, read_sync


def _sse(*events: dict, done: bool = True) -> bytes:
    body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _client(status: int, body: bytes, content_type: str = "text/event-stream") -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"content-type": content_type})))


def test_a_streamed_chat_answer_becomes_text_chunk_times_and_usage():
    body = _sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "Hel"}}]},
                {"choices": [{"delta": {"content": "lo"}}]},
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                          "prompt_tokens_details": {"cached_tokens": 4}}})
    record = read_sync(_client(200, body), "http://x/v1/chat/completions", {"stream": True})
    assert record.ok and record.finished and record.text == "Hello" and len(record.chunk_times_s) == 2
    assert (record.num_output_tokens, record.num_prompt_tokens, record.cached_tokens) == (2, 7, 4)


def test_a_whole_answer_is_one_chunk_and_an_error_status_is_recorded_not_raised():
    answer = {"choices": [{"text": "four words right here"}], "usage": {"completion_tokens": 4, "prompt_tokens": 3}}
    record = read_sync(_client(200, json.dumps(answer).encode(), "application/json"), "http://x/v1/completions", {})
    assert record.ok and record.text == "four words right here" and record.num_output_tokens == 4
    failed = read_sync(_client(503, b"busy"), "http://x/v1/completions", {})
    assert failed.status == 503 and "HTTP 503" in failed.error and not failed.ok


def test_a_stream_that_breaks_keeps_its_prefix_and_says_why():
    lines = _sse({"choices": [{"text": "a"}]}, {"error": {"message": "decode worker gone"}}, done=False)
    record = read_lines(RequestRecord(), lines.decode().splitlines())
    assert record.text == "a" and "decode worker gone" in record.error and not record.finished


def test_the_drivers_give_one_record_per_call_in_order(monkeypatch):
    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        return httpx.Response(200, content=_sse({"choices": [{"text": prompt}]}),
                              headers={"content-type": "text/event-stream"})

    calls = [Call("/v1/completions", {"prompt": f"p{i}"}, at_s=0.01 * i, index=i) for i in range(5)]
    mock = httpx.MockTransport(handler)
    original = httpx.AsyncClient.__init__

    def with_mock(self, *args, **kwargs):  # the drivers build their own clients
        original(self, *args, **{**kwargs, "transport": mock})

    monkeypatch.setattr(httpx.AsyncClient, "__init__", with_mock)
    opened = run_open_loop("http://x", calls, max_concurrency=2)
    closed = run_open_loop("http://x", [Call(c.path, c.body, index=c.index) for c in calls], 3, keep_alive=False)
    assert [r.text for r in opened.records] == [f"p{i}" for i in range(5)] and opened.duration_s >= 0.04
    assert [r.text for r in closed.records] == [f"p{i}" for i in range(5)]  # a closed loop: every arrival at 0
