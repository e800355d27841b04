"""The load drivers over the one stream reader: open loop (each call at its arrival time, optionally
at most N in flight: with every arrival at 0, a closed loop of N), and conversations (each answer
joins the history of the next turn).

Invariant: every call yields exactly one record (a failure is recorded, it never stops the run or
the other calls), and all times of one run are read from one clock started with the run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence, TypeVar

import httpx

from bench.lib.stream import Body, Clock, RequestRecord, read_async

T = TypeVar("T")
READ_TIMEOUT_S = 900.0  # a long prompt queued behind others can take minutes on a small CPU
FIRST_TURN, LATER_TURN = "first turn", "later turns"  # the classes `run_conversations` gives turns by default


@dataclass(slots=True)
class Call:
    """One request of a plan: where, what, when (seconds after the run starts) and its record's labels."""

    path: str
    body: Body
    at_s: float = 0.0
    index: int = 0
    class_name: str = ""
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    headers: dict = field(default_factory=dict)
    name: str = ""  # what the plan calls it (soak, chaos)
    kind: str = "good"

    def record(self) -> RequestRecord:
        return RequestRecord(self.index, self.class_name, self.num_prompt_tokens, self.max_tokens)


Send = Callable[[httpx.AsyncClient, str, Call, Clock], Awaitable[T]]


async def read_call(client: httpx.AsyncClient, base_url: str, call: Call, clock: Clock) -> RequestRecord:
    return await read_async(client, base_url + call.path, call.body, clock, call.record(), call.headers)


@dataclass(slots=True)
class LoadResult:
    records: list
    duration_s: float  # first send to last answer


def _client(num_connections: int, keep_alive: bool = True) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections,
                          max_keepalive_connections=num_connections if keep_alive else 0)
    return httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=30.0), limits=limits)


def _duration(records: Sequence[RequestRecord]) -> float:
    """First send to last answer; 0 when nothing was answered."""
    ends = [r.done_s for r in records if r.done_s is not None]
    return max(ends) - min(r.sent_s for r in records) if ends else 0.0


async def _open_loop(base_url: str, calls: Sequence[Call], max_concurrency: Optional[int], send: Send,
                     on_done: Callable[[T], None], keep_alive: bool) -> LoadResult:
    started_s = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started_s

    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client: httpx.AsyncClient, call: Call):
        await asyncio.sleep(max(0.0, call.at_s - clock()))
        if gate is None:
            record = await send(client, base_url, call, clock)
        else:
            async with gate:
                record = await send(client, base_url, call, clock)
        on_done(record)
        return record

    async with _client(max_concurrency or max(1, len(calls)), keep_alive) as client:
        records = list(await asyncio.gather(*(one(client, call) for call in calls)))
    return LoadResult(records, _duration(records))


def run_open_loop(base_url: str, calls: Sequence[Call], max_concurrency: Optional[int] = None,
                  send: Send = read_call, on_done: Callable[[T], None] = lambda record: None,
                  keep_alive: bool = True) -> LoadResult:
    """Sends every call at its `at_s` (at most `max_concurrency` in flight, if given; they start in
    order as earlier ones end); `keep_alive=False` opens a connection per call."""
    return asyncio.run(_open_loop(base_url, calls, max_concurrency, send, on_done, keep_alive))


async def _conversation(client: httpx.AsyncClient, url: str, conversation, body: dict, clock: Clock,
                        records: list, on_turn: Callable[[], None], class_of: Callable[[int], str]) -> None:
    await asyncio.sleep(max(0.0, conversation.arrival_s - clock()))
    messages = [{"role": "system", "content": conversation.system_prompt}]
    for turn, question in enumerate(conversation.questions):
        messages.append({"role": "user", "content": question})
        record = RequestRecord(len(records), class_of(turn), 0, body.get("max_tokens", 0))
        records.append(record)
        await read_async(client, url + "/v1/chat/completions", {**body, "messages": messages}, clock, record)
        on_turn()
        if record.error is not None or turn == len(conversation.questions) - 1:
            return  # a failed turn ends its conversation; no think time after the last
        messages.append({"role": "assistant", "content": record.text})
        await asyncio.sleep(conversation.think_times_s[turn])


async def _conversations(url: str, conversations: Sequence, body: dict, on_turn: Callable[[], None],
                         class_of: Callable[[int], str]) -> LoadResult:
    started_s = time.perf_counter()
    records: list[RequestRecord] = []

    def clock() -> float:
        return time.perf_counter() - started_s

    async with _client(len(conversations) + 1) as client:
        await asyncio.gather(*(_conversation(client, url, c, body, clock, records, on_turn, class_of)
                               for c in conversations))
    return LoadResult(records, clock())


def run_conversations(url: str, conversations: Sequence, body: dict, on_turn: Callable[[], None] = lambda: None,
                      class_of: Callable[[int], str] = lambda turn: FIRST_TURN if turn == 0 else LATER_TURN,
                      ) -> LoadResult:
    """Each conversation (`arrival_s`, `system_prompt`, `questions`, `think_times_s`) turn after turn (the next
    question after the answer plus that turn's think time); conversations overlap as their arrivals say. `body`
    holds everything but messages."""
    return asyncio.run(_conversations(url, conversations, body, on_turn, class_of))
