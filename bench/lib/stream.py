"""The one OpenAI stream reader of the benchmarks: an answer, streamed (SSE) or whole, becomes one
`RequestRecord`: its text, the arrival of every token-carrying chunk, its usage, its error.

Invariant: a failure (error status, error event, bad JSON, dropped connection) lands on the record
and is never raised out of `read_async`/`read_sync`; every time on a record comes from the caller's
one clock.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

import httpx

Clock = Callable[[], float]
Body = Union[dict, bytes]


class StreamError(RuntimeError):
    """The server answered with an error status, an error event or a line that is not JSON."""


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds on the caller's clock."""

    index: int = 0
    class_name: str = ""
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    chunk_num_tokens: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    done_s: Optional[float] = None
    error: Optional[str] = None
    text: str = ""
    usage: Optional[dict] = None
    status: int = 0  # 0: no HTTP answer
    finished: bool = False  # a stream that said [DONE], or a whole (non-streamed) answer

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and bool(self.chunk_times_s)

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def parse_event(line: str) -> Optional[dict]:
    """The JSON of one `data:` line; None for other lines and for `[DONE]`; StreamError on an error event."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        raise StreamError(f"not a JSON event: {payload[:200]!r}") from None
    if "error" in event:
        raise StreamError(f"server error mid-stream: {json.dumps(event['error'])[:300]}")
    return event


def choice_text(choice: dict) -> str:
    """A completion's `text`, a chat chunk's `delta.content` or a whole chat answer's `message.content`."""
    if choice.get("text") is not None:
        return choice["text"]
    part = choice.get("delta") or choice.get("message") or {}
    return part.get("content") or ""


def chunk_num_tokens(event: dict) -> int:
    """Tokens a chunk carries: exact with completion logprobs, else one per non-empty choice, 0 for usage."""
    num_tokens = 0
    for choice in event.get("choices") or ():
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("tokens") is not None:
            num_tokens += len(logprobs["tokens"])
        elif choice_text(choice):
            num_tokens += 1
    return num_tokens


def take_line(record: RequestRecord, line: str, now_s: float) -> bool:
    """Adds one SSE line to the record; True when it was an event (data or [DONE]).

    An error event is recorded and reading goes on: a stream that broke says so, then ends."""
    if line.startswith("data:") and line[len("data:"):].strip() == "[DONE]":
        record.finished = True
        return True
    try:
        event = parse_event(line)
    except StreamError as exc:
        record.error = record.error or f"{type(exc).__name__}: {exc}"[:300]
        return True
    if event is None:
        return False
    num_tokens = chunk_num_tokens(event)
    if num_tokens:
        record.chunk_times_s.append(now_s)
        record.chunk_num_tokens.append(num_tokens)
        record.text += "".join(choice_text(c) for c in event.get("choices") or ())
    if event.get("usage"):
        record.usage = event["usage"]
    return True


def take_whole(record: RequestRecord, raw: str, now_s: float) -> None:
    """A non-streamed answer: one chunk holding every token, at `now_s`."""
    try:
        answer = json.loads(raw)
        record.text = choice_text(answer["choices"][0])
    except (ValueError, KeyError, IndexError, TypeError):
        record.error = f"not an answer: {raw[:200]!r}"
        return
    record.usage = answer.get("usage")
    record.chunk_times_s.append(now_s)
    record.chunk_num_tokens.append((record.usage or {}).get("completion_tokens") or 1)
    record.finished = True


def finish(record: RequestRecord, now_s: float) -> RequestRecord:
    """The usage chunk counts exactly; chunk counting is the fallback for servers without it. An answer
    without tokens is no error here (a greedy answer may be empty); `ok` asks for tokens."""
    record.done_s = now_s
    usage_tokens = (record.usage or {}).get("completion_tokens")
    record.num_output_tokens = usage_tokens if usage_tokens is not None else sum(record.chunk_num_tokens)
    if not record.num_prompt_tokens and record.usage:
        record.num_prompt_tokens = int(record.usage.get("prompt_tokens") or 0)
    return record


def _content(body: Body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _fail(record: RequestRecord, exc: Exception) -> None:
    record.error = record.error or f"{type(exc).__name__}: {exc}"[:300]


async def read_async(client: httpx.AsyncClient, url: str, body: Body, clock: Clock = time.monotonic,
                     record: Optional[RequestRecord] = None, headers: Optional[dict] = None) -> RequestRecord:
    """POSTs `body` to `url` and reads the answer, streamed or whole, into `record`."""
    record = record if record is not None else RequestRecord()
    record.sent_s = clock()
    try:
        async with client.stream("POST", url, content=_content(body),
                                 headers={"content-type": "application/json", **(headers or {})}) as reply:
            record.status = reply.status_code
            if reply.status_code != 200:
                raise StreamError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            if not reply.headers.get("content-type", "").startswith("text/event-stream"):
                take_whole(record, (await reply.aread()).decode(errors="replace"), clock())
            else:
                async for line in reply.aiter_lines():
                    take_line(record, line, clock())
    except (StreamError, httpx.HTTPError) as exc:
        _fail(record, exc)
    return finish(record, clock())


def read_lines(record: RequestRecord, lines: Iterable[str], clock: Clock = time.monotonic,
               max_events: Optional[int] = None) -> RequestRecord:
    """Reads SSE lines into `record`, stopping after `max_events` events (None: to the end)."""
    for line in lines:
        if take_line(record, line, clock()) and max_events is not None:
            max_events -= 1
            if max_events == 0:
                break
    return record


def read_sync(client: httpx.Client, url: str, body: Body, clock: Clock = time.monotonic,
              record: Optional[RequestRecord] = None, headers: Optional[dict] = None) -> RequestRecord:
    """`read_async` for threads: the same record from a blocking client."""
    record = record if record is not None else RequestRecord()
    record.sent_s = clock()
    try:
        with client.stream("POST", url, content=_content(body),
                           headers={"content-type": "application/json", **(headers or {})}) as reply:
            record.status = reply.status_code
            if reply.status_code != 200:
                raise StreamError(f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
            if not reply.headers.get("content-type", "").startswith("text/event-stream"):
                take_whole(record, reply.read().decode(errors="replace"), clock())
            else:
                read_lines(record, reply.iter_lines(), clock)
    except (StreamError, httpx.HTTPError) as exc:
        _fail(record, exc)
    return finish(record, clock())
