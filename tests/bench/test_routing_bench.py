"""bench.routing's multi-turn workload without processes: seeded think times (fixed or exponential), concurrent
users, the conversation driver's pacing, and the rounds pooled and ratioed against the off arm (peer pulls off)."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from bench.lib.load import LoadResult, run_conversations
from bench.lib.stream import RequestRecord
from bench.routing.report import PolicyResult, format_table, merge, summarize, verdict, vs_off_arm
from bench.routing.workload import WorkloadSpec, build_conversations


def test_exponential_think_times_are_seeded_have_their_mean_and_leave_the_questions_alone():
    spec = WorkloadSpec(num_conversations=200, think_time_s=2.0, think_distribution="exponential",
                        conversations_per_s=0.0, seed=3)
    conversations = build_conversations(spec)
    times_s = [t for c in conversations for t in c.think_times_s]
    assert [len(c.think_times_s) for c in conversations] == [len(c.questions) - 1 for c in conversations]
    assert len(set(times_s)) == len(times_s) and 1.8 < sum(times_s) / len(times_s) < 2.2  # ~1,000 draws
    assert build_conversations(spec) == conversations  # both arms of a run see the very same workload
    assert [c.think_times_s for c in build_conversations(replace(spec, seed=4))] != [c.think_times_s
                                                                                     for c in conversations]
    assert {c.arrival_s for c in conversations} == {0.0}  # rate 0: every user starts at once
    fixed = build_conversations(replace(spec, think_distribution="fixed"))
    assert [c.questions for c in fixed] == [c.questions for c in conversations]
    assert {t for c in fixed for t in c.think_times_s} == {2.0}
    with pytest.raises(ValueError):
        build_conversations(replace(spec, think_distribution="normal"))


def test_each_next_turn_waits_its_think_time_after_the_answer_and_carries_the_history(monkeypatch):
    seen: list[list[dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        seen.append(messages)
        answer = {"choices": [{"message": {"content": f"answer {len(messages)}"}}],
                  "usage": {"prompt_tokens": len(messages), "completion_tokens": 2}}
        return httpx.Response(200, content=json.dumps(answer).encode(), headers={"content-type": "application/json"})

    mock, original = httpx.MockTransport(handler), httpx.AsyncClient.__init__
    monkeypatch.setattr(httpx.AsyncClient, "__init__",
                        lambda self, *args, **kwargs: original(self, *args, **{**kwargs, "transport": mock}))
    conversation = replace(build_conversations(WorkloadSpec(num_conversations=1, min_turns=3, max_turns=3))[0],
                           think_times_s=(0.25, 0.0))
    records = run_conversations("http://x", [conversation], {"max_tokens": 2}).records
    assert [r.ok for r in records] == [True, True, True]
    assert records[1].sent_s - records[0].done_s >= 0.25 - 1e-3  # the think time after answer 1, not before
    assert records[1].sent_s >= records[0].done_s and records[2].sent_s >= records[1].done_s
    assert [m["content"] for m in seen[2] if m["role"] == "assistant"] == ["answer 2", "answer 4"]


def _arm(policy: str, computed_tokens: float, ttfts_s: list[float], pulled_tokens: float = 0.0) -> PolicyResult:
    records = [RequestRecord(i, "later turns", 100, 2, sent_s=0.0, chunk_times_s=[t], chunk_num_tokens=[2],
                             num_output_tokens=2, done_s=t + 0.1) for i, t in enumerate(ttfts_s)]
    result = LoadResult(records, 10.0)
    return PolicyResult(policy, summarize(policy, result), result, prompt_tokens=100 * len(records),
                        computed_prefill_tokens=computed_tokens, computed_decode_tokens=0.0, kv_bytes_pulled=0.0,
                        kv_events=0.0, decode_only_turns=0.0, prediction_error_tokens=None,
                        peer_pulled_tokens=pulled_tokens)


def test_rounds_pool_their_turns_and_the_peer_arm_is_ratioed_against_its_off_arm():
    off = merge([_arm("least_loaded", 600.0, [1.0, 3.0]), _arm("least_loaded", 400.0, [2.0, 4.0])])
    on = merge([_arm("least_loaded+peer", 250.0, [0.5, 1.5], 300.0), _arm("least_loaded+peer", 250.0, [1.0, 4.0],
                                                                           200.0)])
    assert (off.computed_tokens, off.prompt_tokens, off.summary.num_requests, off.result.duration_s) == (
        1000.0, 400, 4, 20.0)
    assert on.peer_pulled_tokens == 500.0 and on.summary.overall.ttft.p50 == pytest.approx(1.25)
    ratios = vs_off_arm(on, [off, on])
    assert ratios == pytest.approx({"computed_tokens": 0.5, "ttft_p50": 0.5, "ttft_p99": 3.925 / 3.97})
    assert vs_off_arm(off, [off, on]) is None  # an off arm has no off arm of its own
    assert "0.50 / 0.50 / 0.99" in format_table([off, on])
    assert verdict([off, on])[0].startswith("least_loaded+peer against least_loaded: prompt tokens computed 0.50x")
