"""Mixed load for the chaos runs: good requests (completions and chat, streamed and not, greedy) sent
through the proxy by a few threads, each answer judged against its greedy baseline.

Invariant: every request sent yields exactly one `Result` with its start and end time, so each can
be charged to the kill whose window it overlaps; a request is never retried by the load itself.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from bench._soak_load import Call, good_calls

HANG_S = 60.0  # a client call taking longer than this is a hang
OK, CUT, LOST, WRONG, HANG = "ok", "cut", "lost", "wrong", "hang"
OUTCOMES = (OK, CUT, LOST, WRONG, HANG)


@dataclass(slots=True)
class Result:
    name: str
    stream: bool
    started_s: float
    ended_s: float
    status: int = 0  # 0: no HTTP answer
    text: str = ""
    error: str = ""  # an error event, a transport error or a non-200 body
    done: bool = False  # a stream ended with [DONE]
    timed_out: bool = False


def send(client: httpx.Client, base_url: str, call: Call, request_id: Optional[str] = None) -> Result:
    """One call; its text is what the client saw (for a broken stream: the part that arrived)."""
    stream = bool(call.body.get("stream"))
    result = Result(call.name, stream, time.monotonic(), 0.0)
    headers = {"X-Request-Id": request_id} if request_id else {}
    try:
        with client.stream("POST", base_url + call.path, json=call.body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = response.read().decode(errors="replace")[:300]
            elif stream:
                _read_stream(response, result)
            else:
                result.text = _choice_text(json.loads(response.read())["choices"][0])
    except httpx.TimeoutException as error:
        result.timed_out, result.error = True, type(error).__name__
    except httpx.HTTPError as error:
        result.error = result.error or type(error).__name__
    result.ended_s = time.monotonic()
    return result


def _read_stream(response: httpx.Response, result: Result) -> None:
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            result.done = True
            continue
        payload = json.loads(data)
        if "error" in payload:
            result.error = json.dumps(payload["error"])[:300]
            continue
        for choice in payload.get("choices", []):
            result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _choice_text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def classify(result: Result, expected: str, hang_s: float = HANG_S) -> str:
    """ok: 200 and the baseline; cut: a stream that said it broke (or lost its connection) after a
    prefix of the baseline; lost: no answer, or an error status; wrong: any other text; hang: too slow."""
    if result.timed_out or result.ended_s - result.started_s > hang_s:
        return HANG
    if result.status != 200:
        return LOST
    if not result.stream:
        return OK if result.text == expected else WRONG
    if result.done and not result.error:
        return OK if result.text == expected else WRONG
    if result.error and expected.startswith(result.text):
        return CUT if result.text else LOST
    return WRONG  # a stream that stopped without saying so, or a broken one with tokens not in the baseline


class MixedLoad:
    """Threads sending `calls` through the proxy until stopped; `gate` pauses new requests."""

    def __init__(self, base_url: str, num_threads: int, seed: int, calls: Optional[list[Call]] = None):
        self.base_url = base_url
        self.calls = calls or good_calls()
        self.results: list[Result] = []
        self.gate = threading.Event()
        self.gate.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed + i), i), daemon=True)
                         for i in range(num_threads)]

    def start(self) -> "MixedLoad":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.gate.set()
        for thread in self._threads:
            thread.join(HANG_S + 30)

    def wait_quiet(self, timeout_s: float = HANG_S + 5) -> bool:
        """With the gate closed: wait until no load request is in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._in_flight == 0:
                    return True
            time.sleep(0.02)
        return False

    def _run(self, rng: random.Random, index: int) -> None:
        with httpx.Client(timeout=HANG_S) as client:
            number = 0
            while not self._stop.is_set():
                self.gate.wait()
                if self._stop.is_set():
                    return
                with self._lock:
                    if not self.gate.is_set():
                        continue
                    self._in_flight += 1
                call = rng.choice(self.calls)
                number += 1
                result = send(client, self.base_url, call, f"load-{index}-{number}")
                with self._lock:
                    self._in_flight -= 1
                    self.results.append(result)


def baselines(base_url: str, calls: list[Call]) -> dict[str, str]:
    """Each call's greedy answer, asked once at a time."""
    answers = {}
    with httpx.Client(timeout=HANG_S) as client:
        for call in calls:
            result = send(client, base_url, call)
            if result.status != 200 or result.error or (result.stream and not result.done):
                raise RuntimeError(f"baseline {call.name} failed: {result.status} {result.error}")
            answers[call.name] = result.text
    return answers
