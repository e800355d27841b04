"""Open-loop streaming load: each synthetic request goes out at its arrival time, and the client
records when every token-carrying SSE chunk of `/v1/completions` arrives.

Invariant: a request's failure (HTTP error, error event, dropped connection) is
recorded on its own record and never stops the run or the other requests, and
every time on a record is measured on one clock, relative to the run's start.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from bench.serving.workload import SyntheticRequest

_READ_TIMEOUT_S = 900.0  # a long prompt queued behind others can take minutes on a small CPU


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go and how they are spelled.

    `logprobs=0` makes the server emit every token as its own chunk (a token
    whose text is still an incomplete character would otherwise be merged into
    the next chunk), so inter-token gaps are per token, not per visible piece."""

    base_url: str
    model: Optional[str] = None
    with_logprobs: bool = True

    def body(self, request: SyntheticRequest) -> dict:
        body = {"prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.with_logprobs:
            body["logprobs"] = 0
        return body


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds since the run started."""

    index: int
    class_name: str
    num_prompt_tokens: int
    max_tokens: int
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    chunk_num_tokens: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    done_s: Optional[float] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and bool(self.chunk_times_s)


class StreamError(RuntimeError):
    """The server answered with an error status or an error event."""


def parse_event(line: str) -> Optional[dict]:
    """The JSON of one `data:` line; None for other lines and for `[DONE]`."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    event = json.loads(payload)
    if "error" in event:
        raise StreamError(f"error event: {event['error']}")
    return event


def chunk_num_tokens(event: dict) -> int:
    """Tokens a completion chunk carries: exact with logprobs, else one per non-empty chunk, 0 for usage."""
    num_tokens = 0
    for choice in event.get("choices") or ():
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("tokens") is not None:
            num_tokens += len(logprobs["tokens"])
        elif choice.get("text"):
            num_tokens += 1
    return num_tokens


async def stream_request(client: httpx.AsyncClient, endpoint: Endpoint, request: SyntheticRequest,
                         clock: Callable[[], float]) -> RequestRecord:
    record = RequestRecord(request.index, request.class_name, len(request.prompt_token_ids), request.max_tokens)
    record.sent_s = clock()
    usage_tokens: Optional[int] = None
    try:
        async with client.stream("POST", f"{endpoint.base_url}/v1/completions", json=endpoint.body(request)) as reply:
            if reply.status_code != 200:
                raise StreamError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            async for line in reply.aiter_lines():
                event = parse_event(line)
                if event is None:
                    continue
                num_tokens = chunk_num_tokens(event)
                if num_tokens:
                    record.chunk_times_s.append(clock())
                    record.chunk_num_tokens.append(num_tokens)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
        record.done_s = clock()
    except (StreamError, httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    # The usage chunk counts exactly; chunk counting is the fallback for servers without it.
    record.num_output_tokens = usage_tokens if usage_tokens is not None else sum(record.chunk_num_tokens)
    if record.error is None and not record.chunk_times_s:
        record.error = "the stream carried no tokens"
    return record


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last answer


async def _run(endpoint: Endpoint, requests: Sequence[SyntheticRequest], max_concurrency: Optional[int],
               on_done: Callable[[RequestRecord], None]) -> LoadResult:
    started_s = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started_s

    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    num_connections = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    timeout = httpx.Timeout(_READ_TIMEOUT_S, connect=30.0)

    async def one(client: httpx.AsyncClient, request: SyntheticRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, request.arrival_offset_s - clock()))
        if gate is None:
            record = await stream_request(client, endpoint, request, clock)
        else:
            async with gate:
                record = await stream_request(client, endpoint, request, clock)
        on_done(record)
        return record

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        records = await asyncio.gather(*(one(client, request) for request in requests))
    ends = [r.done_s for r in records if r.done_s is not None]
    sends = [r.sent_s for r in records]
    return LoadResult(list(records), (max(ends) - min(sends)) if ends else 0.0)


def run_load(endpoint: Endpoint, requests: Sequence[SyntheticRequest], max_concurrency: Optional[int] = None,
             on_done: Callable[[RequestRecord], None] = lambda record: None) -> LoadResult:
    """Sends every request at its arrival offset (at most `max_concurrency` in flight, if given)."""
    return asyncio.run(_run(endpoint, requests, max_concurrency, on_done))
