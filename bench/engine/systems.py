"""The engine benchmark's HTTP systems (pdserve, llama-server, transformers serve): chat requests over
the one stream reader, phases at a fixed concurrency over the closed-loop driver.

Invariant: a phase keeps exactly `concurrency` requests in flight until its
queue drains, and a request that failed fails its phase (an error row, never a fast one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import httpx

from bench.engine.report import PhaseResult, RequestSample, summarize
from bench.engine.workload import chat_messages
from bench.lib.launch import LaunchError, ServerProcess
from bench.lib.load import Call, run_open_loop
from bench.lib.stream import RequestRecord, read_async

Messages = Callable[[int], list[dict[str, str]]]  # request index -> chat messages

logger = logging.getLogger(__name__)
BenchError = LaunchError  # a system under test could not be started or answered wrongly


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """Where to send chat requests and the body fields that force exactly `max_tokens` outputs."""

    base_url: str
    model: str
    extra_body: dict


# Exactly `max_tokens` outputs (EOS ignored) and the usage chunk that counts them: pdserve, llama-server.
IGNORE_EOS_BODY = {"ignore_eos": True, "stream_options": {"include_usage": True}}


def _call(target: HttpTarget, index: int, max_tokens: int, messages: Messages) -> Call:
    body = {"model": target.model, "messages": messages(index), "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True} | target.extra_body
    return Call("/v1/chat/completions", body, index=index, max_tokens=max_tokens)


def _sample(record: RequestRecord) -> RequestSample:
    """TTFT is the arrival of the first content delta; a failed request raises (its phase fails)."""
    if record.error is not None:
        raise BenchError(record.error)
    if not record.chunk_times_s:
        raise BenchError(f"request {record.index} streamed no content")
    return RequestSample(record.chunk_times_s[0] - record.sent_s, record.done_s - record.sent_s,
                         record.num_output_tokens)


async def stream_one(client: httpx.AsyncClient, target: HttpTarget, index: int, max_tokens: int,
                     messages: Messages = chat_messages) -> RequestSample:
    """One streamed chat request."""
    call = _call(target, index, max_tokens, messages)
    return _sample(await read_async(client, target.base_url + call.path, call.body, record=call.record()))


def run_phase(target: HttpTarget, indices: Sequence[int], concurrency: int, max_tokens: int,
              messages: Messages = chat_messages) -> tuple[list[RequestSample], float]:
    """Requests `indices`, `concurrency` at a time, each on a new connection, for every server alike:
    llama-server closed kept-alive connections between requests (see `first_token_times`), which
    failed its c=1 phase once. Returns the samples and the phase's wall time."""
    calls = [_call(target, index, max_tokens, messages) for index in indices]
    result = run_open_loop(target.base_url, calls, concurrency, keep_alive=False)
    return [_sample(record) for record in result.records], result.duration_s


def first_token_times(target: HttpTarget, indices: Sequence[int], messages: Messages) -> list[float]:
    """TTFT of each request in `indices`, sent one at a time (nothing else in flight), each on a
    new connection: llama-server closed a kept-alive connection between two of these requests
    ("Server disconnected without sending a response" on the next POST, which httpx does not
    retry); a local connect costs microseconds against seconds of prefill."""
    samples, _ = run_phase(target, indices, 1, 2, messages)
    return [sample.ttft_s for sample in samples]


def check_exact_lengths(samples: Sequence[RequestSample], max_tokens: int, system: str) -> None:
    """Throughput is only comparable if every system generated the same number of tokens."""
    off = [s.num_output_tokens for s in samples if s.num_output_tokens != max_tokens]
    if off:
        logger.warning("%s: %d requests did not produce exactly %d tokens: %s", system, len(off), max_tokens, off)


class HttpSystem:
    """A server under test: started once, warmed up, then measured phase by phase."""

    def __init__(self, server: Optional[ServerProcess], make_target: Callable[[ServerProcess], HttpTarget]):
        self.name = server.name if server is not None else self.name
        self._server = server
        self._make_target = make_target
        self._target: Optional[HttpTarget] = None

    @property
    def pids(self) -> list[int]:
        process = self._server.process if self._server is not None else None
        return [process.pid] if process is not None else []

    def start(self, ready_timeout_s: float) -> None:
        self._server.start().wait_ready(ready_timeout_s)
        self._target = self._make_target(self._server)

    def prepare(self, concurrency: int) -> None:
        """Nothing to do between phases: one server serves every concurrency."""

    def target(self) -> HttpTarget:
        if self._target is None:
            raise BenchError(f"{self.name} is not running")
        return self._target

    def warm_up(self, indices: Sequence[int], concurrencies: Sequence[int], max_tokens: int) -> None:
        """At the highest concurrency only: lazy set-up (batchers, allocator pools) happens on first use."""
        top = max(concurrencies)
        run_phase(self._target, indices[:top], top, max_tokens)

    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]:
        return first_token_times(self.target(), indices, messages)

    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult:
        samples, wall_s = run_phase(self.target(), indices, concurrency, max_tokens)
        check_exact_lengths(samples, max_tokens, self.name)
        return summarize(self.name, concurrency, samples, wall_s)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
