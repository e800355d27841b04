"""Drives the conversations: each turn is a streamed chat completion whose answer joins the history.

Invariant: a conversation's turns go out one after the other (the next question
only after the previous answer, plus the think time), conversations overlap as
their arrivals say; a failed turn ends its conversation and is recorded, never
stops the run. Times are seconds since the run started, on one clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from bench.multiturn.workload import ConversationSpec, WorkloadSpec
from bench.serving.client import RequestRecord

FIRST_TURN = "first turn"
LATER_TURN = "later turns"
_TIMEOUT = httpx.Timeout(600.0, connect=30.0)


@dataclass(slots=True)
class TurnUsage:
    """What the answer's usage chunk said (the decode worker's view)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord] = field(default_factory=list)
    usages: list[TurnUsage] = field(default_factory=list)
    duration_s: float = 0.0


async def stream_turn(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord,
                      clock: Callable[[], float]) -> tuple[str, TurnUsage]:
    """One streamed chat completion; the answer's text and usage. Failures land on the record."""
    pieces: list[str] = []
    usage = TurnUsage()
    record.sent_s = clock()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                text = "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())
                if text:
                    record.chunk_times_s.append(clock())
                    record.chunk_num_tokens.append(1)
                    pieces.append(text)
                if event.get("usage"):
                    usage = _usage(event["usage"])
        record.done_s = clock()
    except (RuntimeError, httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.num_prompt_tokens = usage.prompt_tokens
    record.num_output_tokens = len(record.chunk_times_s)
    if record.error is None and not record.chunk_times_s:
        record.error = "the stream carried no tokens"
    return "".join(pieces), usage


def _usage(usage: dict) -> TurnUsage:
    details = usage.get("prompt_tokens_details") or {}
    return TurnUsage(int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0))


async def _conversation(client: httpx.AsyncClient, url: str, spec: WorkloadSpec, conversation: ConversationSpec,
                        clock: Callable[[], float], result: RunResult, on_turn: Callable[[], None]) -> None:
    await asyncio.sleep(max(0.0, conversation.arrival_s - clock()))
    messages = [{"role": "system", "content": conversation.system_prompt}]
    for turn, question in enumerate(conversation.questions):
        messages.append({"role": "user", "content": question})
        body = {"messages": messages, "max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        record = RequestRecord(len(result.records), FIRST_TURN if turn == 0 else LATER_TURN, 0, spec.max_tokens)
        result.records.append(record)
        answer, usage = await stream_turn(client, url, body, record, clock)
        result.usages.append(usage)
        on_turn()
        if record.error is not None:
            return
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(spec.think_time_s)


async def _run(url: str, spec: WorkloadSpec, conversations: Sequence[ConversationSpec],
               on_turn: Callable[[], None]) -> RunResult:
    started_s = time.perf_counter()
    result = RunResult()

    def clock() -> float:
        return time.perf_counter() - started_s

    limits = httpx.Limits(max_connections=len(conversations) + 1)
    async with httpx.AsyncClient(timeout=_TIMEOUT, limits=limits) as client:
        await asyncio.gather(*(_conversation(client, url, spec, c, clock, result, on_turn) for c in conversations))
    result.duration_s = clock()
    return result


def run_conversations(url: str, spec: WorkloadSpec, conversations: Sequence[ConversationSpec],
                      on_turn: Optional[Callable[[], None]] = None) -> RunResult:
    return asyncio.run(_run(url, spec, conversations, on_turn or (lambda: None)))
