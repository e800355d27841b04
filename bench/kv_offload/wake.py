"""How long an ended file-tier load waits for the engine thread to land it (`--wake-only`), with
the tier waking the engine thread ("wake", what a worker does) and without ("no wake": the next
poll). A real engine thread, a pool smaller than its prompts, prefixes coming back from the tier;
modes interleaved round by round. Measured per load: read end (I/O thread) to landing, and TTFT.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import torch

from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.app.engine_factory import build_engine
from pdserve.metrics import Metrics
from pdserve.request import GenerationRequest

MODES = ("wake", "no wake")


def wake_latency(loaded, directory: str, rounds: int, prompt_tokens: int = 320) -> dict:  # noqa: ANN001
    config = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=40, kv_offload_bytes=2 << 30,
                                            kv_offload_dir=directory),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_running=4))
    built = build_engine(config, Metrics(), loaded)
    loop, tier = built.engine.engine_loop, built.kv_manager.offload
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.spec.vocab_size
    # 8 prompts of 20 blocks each through a pool of 39: each pass pushes the others' prefixes to the tier
    prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(8)]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    read_ended: list[float] = []
    landing_s: list[float] = []
    read, poll = tier.store.read, tier.poll

    def timed_read(slots, block_ids):  # noqa: ANN001 - on the I/O thread
        read(slots, block_ids)
        read_ended.append(time.perf_counter())

    def timed_poll():  # noqa: ANN202 - on the engine thread
        results = poll()
        if results.landed and read_ended:
            landing_s.append(time.perf_counter() - read_ended[-1])
        return results

    tier.store.read, tier.poll = timed_read, timed_poll
    wakes = {"wake": loop.wake, "no wake": lambda: None}
    ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
    landings: dict[str, list[float]] = {mode: [] for mode in MODES}
    number = itertools.count()

    def ask(prompt: list[int]) -> float:
        done, first = threading.Event(), []

        def sink(output):  # noqa: ANN001
            if output.new_token_ids and not first:
                first.append(time.perf_counter())
            if output.finished:
                done.set()

        started = time.perf_counter()
        loop.submit(GenerationRequest(f"wake-{next(number)}", tuple(prompt), sampling), sink)
        if not done.wait(120):
            raise RuntimeError("a request did not finish in 2 minutes")
        return first[0] - started

    loop.start()
    try:
        for prompt in prompts:  # every prompt computed once, so each later ask finds its prefix somewhere
            ask(prompt)
        for _ in range(rounds):
            for mode in MODES:
                for prompt in prompts[4:]:  # the first four's prefixes leave the pool
                    ask(prompt)
                tier.wake_on_results(wakes[mode])
                for prompt in prompts[:4]:
                    before = len(landing_s)
                    ttfts[mode].append(ask(prompt))
                    landings[mode] += landing_s[before:]
    finally:
        built.close()
    result: dict = {"rounds": rounds, "prompt_tokens": prompt_tokens, "modes": {}}
    for mode in MODES:
        result["modes"][mode] = {"ttft_p50_ms": statistics.median(ttfts[mode]) * 1e3,
                                 "landing_p50_ms": statistics.median(landings[mode]) * 1e3 if landings[mode] else None,
                                 "landing_max_ms": max(landings[mode]) * 1e3 if landings[mode] else None,
                                 "requests": len(ttfts[mode]), "loads": len(landings[mode])}
    return result


def print_wake_table(result: dict) -> None:
    print(f"\nfile-tier loads on an idle engine thread, {result['rounds']} rounds, "
          f"{result['prompt_tokens']}-token prompts whose prefixes come back from the tier")
    print(f"{'mode':8} {'requests':>9} {'loads':>6} {'read end -> landed p50':>23} {'max':>8} {'TTFT p50':>9}")
    for mode, row in result["modes"].items():
        landing = (f"{row['landing_p50_ms']:20.2f} ms {row['landing_max_ms']:5.2f} ms"
                   if row["landing_p50_ms"] is not None else f"{'-':>23} {'-':>8}")
        print(f"{mode:8} {row['requests']:9d} {row['loads']:6d} {landing} {row['ttft_p50_ms']:6.1f} ms")
