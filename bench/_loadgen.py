"""Closed-loop streaming load against an OpenAI-compatible server, and the server's process.

Invariant: a phase keeps exactly `concurrency` requests in flight until its
queue drains, and every server started here is stopped on the way out, even
when it never became healthy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from bench._report import PhaseResult, RequestSample, summarize
from bench._workload import chat_messages

Messages = Callable[[int], list[dict[str, str]]]  # request index -> chat messages

logger = logging.getLogger(__name__)

_HTTP_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    """A system under test could not be started or answered wrongly."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    """A server subprocess in its own session, logging to `log_path`."""

    name: str
    argv: Sequence[str]
    port: int
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    process: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float) -> None:
        logger.info("starting %s: %s", self.name, " ".join(self.argv))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                list(self.argv), stdout=log, stderr=subprocess.STDOUT, env=os.environ | self.env,
                start_new_session=True,  # its own process group: stop() reaches any children
            )
        self._wait_healthy(ready_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise BenchError(f"{self.name} not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 600) -> str:
        try:
            with open(self.log_path, "rb") as log:
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return " ".join(text[-num_chars:].split())

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """Where to send chat requests and the body fields that force exactly `max_tokens` outputs."""

    base_url: str
    model: str
    extra_body: dict


def _parse_event(line: str) -> Optional[dict]:
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        raise BenchError(f"not a JSON event: {payload[:200]!r}") from None
    if "error" in event:
        raise BenchError(f"server error mid-stream: {event['error']}")
    return event


def _has_content(event: dict) -> bool:
    return any((choice.get("delta") or {}).get("content") for choice in event.get("choices", ()))


async def stream_one(client: httpx.AsyncClient, target: HttpTarget, index: int, max_tokens: int,
                     messages: Messages = chat_messages) -> RequestSample:
    """One streamed chat request; TTFT is the arrival of the first content delta."""
    body = {"model": target.model, "messages": messages(index), "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True} | target.extra_body
    started_s = time.perf_counter()
    ttft_s: Optional[float] = None
    num_content_events = 0
    num_usage_tokens: Optional[int] = None
    async with client.stream("POST", f"{target.base_url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise BenchError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            event = _parse_event(line)
            if event is None:
                continue
            if _has_content(event):
                num_content_events += 1
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_s
            if event.get("usage"):
                num_usage_tokens = event["usage"].get("completion_tokens")
    e2e_s = time.perf_counter() - started_s
    if ttft_s is None:
        raise BenchError(f"request {index} streamed no content")
    # The usage chunk counts tokens exactly; a content event may carry several tokens.
    return RequestSample(ttft_s, e2e_s, num_usage_tokens if num_usage_tokens is not None else num_content_events)


async def _run_closed_loop(target: HttpTarget, indices: Sequence[int], concurrency: int,
                           max_tokens: int, messages: Messages, keep_alive: bool = True,
                           ) -> tuple[list[RequestSample], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in indices:
        queue.put_nowait(index)
    samples: list[RequestSample] = []
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4 if keep_alive else 0)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            samples.append(await stream_one(client, target, queue.get_nowait(), max_tokens, messages))

    async with httpx.AsyncClient(timeout=_HTTP_TIMEOUT_S, limits=limits) as client:
        started_s = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall_s = time.perf_counter() - started_s
    return samples, wall_s


def run_phase(target: HttpTarget, indices: Sequence[int], concurrency: int, max_tokens: int,
              messages: Messages = chat_messages, keep_alive: bool = True) -> tuple[list[RequestSample], float]:
    """Requests `indices`, `concurrency` at a time; returns the samples and the phase's wall time."""
    return asyncio.run(_run_closed_loop(target, indices, concurrency, max_tokens, messages, keep_alive))


def first_token_times(target: HttpTarget, indices: Sequence[int], messages: Messages) -> list[float]:
    """TTFT of each request in `indices`, sent one at a time (nothing else in flight), each on a
    new connection: llama-server closed a kept-alive connection between two of these requests
    ("Server disconnected without sending a response" on the next POST, which httpx does not
    retry); a local connect costs microseconds against seconds of prefill."""
    samples, _ = run_phase(target, indices, 1, 2, messages, keep_alive=False)
    return [sample.ttft_s for sample in samples]


def check_exact_lengths(samples: Sequence[RequestSample], max_tokens: int, system: str) -> None:
    """Throughput is only comparable if every system generated the same number of tokens."""
    off = [s.num_output_tokens for s in samples if s.num_output_tokens != max_tokens]
    if off:
        logger.warning("%s: %d requests did not produce exactly %d tokens: %s", system, len(off), max_tokens, off)


class HttpSystem:
    """A server under test: started once, warmed up, then measured phase by phase."""

    def __init__(self, server: ServerProcess, make_target: Callable[[ServerProcess], HttpTarget]):
        self.name = server.name
        self._server = server
        self._make_target = make_target
        self._target: Optional[HttpTarget] = None

    @property
    def pids(self) -> list[int]:
        process = self._server.process
        return [process.pid] if process is not None else []

    def start(self, ready_timeout_s: float) -> None:
        self._server.start(ready_timeout_s)
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
        run_phase(self._target, indices[:top], top, max_tokens, keep_alive=False)

    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]:
        return first_token_times(self.target(), indices, messages)

    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult:
        # A new connection per request, for every server alike: llama-server closes kept-alive
        # connections between requests (see `first_token_times`), which failed its c=1 phase once.
        samples, wall_s = run_phase(self._target, indices, concurrency, max_tokens, keep_alive=False)
        check_exact_lengths(samples, max_tokens, self.name)
        return summarize(self.name, concurrency, samples, wall_s)

    def close(self) -> None:
        self._server.stop()
