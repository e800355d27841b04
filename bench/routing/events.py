"""What KV events cost a worker: their rate while its prefill is saturated, and the engine thread's
price per event (committing blocks with the recorder on vs off, in this process).

Invariant: the rate is read from a real subscription to the worker's event
stream, counting only events stamped while the load ran; the prompts are
unique (no prefix hits) and outgrow the pool, so blocks are stored and evicted.
"""

from __future__ import annotations

import random
import threading
import time

import httpx

from bench.lib.launch import internal_url_of
from bench.lib.load import Call, run_open_loop
from pdserve.kv.events_wire import EVENTS, decode_line

TOKEN_HEADER = "X-Pdserve-Internal-Token"


class _Counter(threading.Thread):
    """Reads the worker's event stream and counts events by kind until stopped."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self._url, self._token = url, token
        self.counts = {"stored": 0, "removed": 0, "cleared": 0}
        self.subscribed = threading.Event()
        self.stopped = False

    def run(self) -> None:
        headers = {TOKEN_HEADER: self._token}
        with httpx.stream("GET", internal_url_of(self._url) + "/internal/kv/events", headers=headers, timeout=30) as response:
            for line in response.iter_lines():
                self.subscribed.set()
                if self.stopped:
                    return
                message = decode_line(line.encode())
                if message.type == EVENTS:
                    for event in message.events:
                        self.counts[event.kind.value] += 1


def _saturate(url: str, num_prompts: int, prompt_tokens: int, seed: int) -> float:
    """Every prompt at once (the open-loop driver, all arrivals at 0); seconds until the last answered."""
    rng = random.Random(seed)
    calls = [Call("/v1/completions", {"prompt": [rng.randrange(1000, 20000) for _ in range(prompt_tokens)],
                                      "max_tokens": 1, "temperature": 0}) for _ in range(num_prompts)]
    result = run_open_loop(url, calls)
    failed = [record.error for record in result.records if record.status != 200]
    if failed:
        raise RuntimeError(f"saturating requests failed: {failed[:5]}")
    return result.duration_s


def event_rate_under_load(url: str, token: str, num_prompts: int = 16, prompt_tokens: int = 1000,
                          seed: int = 1) -> dict:
    counter = _Counter(url, token)
    counter.start()
    if not counter.subscribed.wait(30):
        raise RuntimeError("no KV event stream from " + url)
    time.sleep(0.2)
    before = dict(counter.counts)
    elapsed_s = _saturate(url, num_prompts, prompt_tokens, seed)
    time.sleep(0.5)  # the last drain (every 20 ms) and its line
    counter.stopped = True
    events = {kind: counter.counts[kind] - before[kind] for kind in counter.counts}
    total = sum(events.values())
    return {"prompt_tokens": num_prompts * prompt_tokens, "duration_s": elapsed_s, "events": events,
            "events_per_s": total / elapsed_s, "prompt_tokens_per_s": num_prompts * prompt_tokens / elapsed_s}


def recording_cost_us(num_blocks: int = 20_000) -> dict:
    """Engine-thread time per block committed to the prefix cache with recording on and off (best of two)."""
    from pdserve.kv.events import KVEventRecorder
    from pdserve.kv.events_wire import encode_events
    from pdserve.kv.hashing import hash_full_blocks
    from pdserve.kv.manager import KVCacheManager
    from pdserve.kv.specs import FullAttentionSpec, plan_groups

    tokens = list(range(num_blocks * 16))
    hashes = hash_full_blocks(tokens, 16, [])
    timings: dict[bool, float] = {}
    events = []
    for enabled in (False, True, False, True):
        recorder = KVEventRecorder(capacity=num_blocks * 2)
        recorder.enabled = enabled
        manager = KVCacheManager(plan_groups([FullAttentionSpec()]), num_blocks + 1, 16, events=recorder)
        manager.allocate_slots("r", 0, len(tokens))
        started = time.perf_counter()
        manager.commit("r", hashes, len(tokens))
        elapsed_us = (time.perf_counter() - started) * 1e6 / num_blocks
        timings[enabled] = min(timings.get(enabled, elapsed_us), elapsed_us)
        events = recorder.drain() or events
    started = time.perf_counter()
    encode_events("epoch", events, 16)
    encode_us = (time.perf_counter() - started) * 1e6 / len(events)
    return {"commit_us_per_block_recording_off": timings[False], "commit_us_per_block_recording_on": timings[True],
            "engine_thread_us_per_event": timings[True] - timings[False], "server_encode_us_per_event": encode_us}
