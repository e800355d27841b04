"""Mixed load for the chaos runs: good requests (completions and chat, streamed and not, greedy) sent
through the proxy by a few threads, each answer judged against its greedy baseline.

Invariant: every request sent yields exactly one `Result` with its start and end time, so each can
be charged to the kill whose window it overlaps; a request is never retried by the load itself.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Optional

import httpx

from bench.lib.load import Call
from bench.lib.stream import RequestRecord, read_sync
from bench.lib.workloads import good_calls

HANG_S = 60.0  # a client call taking longer than this is a hang
OK, CUT, LOST, WRONG, HANG = "ok", "cut", "lost", "wrong", "hang"
OUTCOMES = (OK, CUT, LOST, WRONG, HANG)
Result = RequestRecord  # class_name: the call's name; sent_s and done_s on time.monotonic()


def send(client: httpx.Client, base_url: str, call: Call, request_id: Optional[str] = None) -> Result:
    """One call; its text is what the client saw (for a broken stream: the part that arrived)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    return read_sync(client, base_url + call.path, call.body, record=Result(class_name=call.name), headers=headers)


def timed_out(result: Result) -> bool:
    return bool(result.error) and result.error.split(":", 1)[0].endswith("Timeout")


def classify(result: Result, expected: str, hang_s: float = HANG_S) -> str:
    """ok: 200 and the baseline; cut: a stream that said it broke (or lost its connection) after a
    prefix of the baseline; lost: no answer, or an error status; wrong: any other text; hang: too slow."""
    if timed_out(result) or result.done_s - result.sent_s > hang_s:
        return HANG
    if result.status != 200:
        return LOST
    if result.finished and not result.error:
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


