"""Decode-step time of the in-process engine, split into matmuls, attention and the rest
(Python, dispatch and the small ops), for fp32 and quantized weights, eager and compiled.

    python -m bench.kernels.decode_step [--rounds 3] [--steps 16] [--variant NAME] [--out bench/results/decode_step.json]

All variants run in one process on the same prompts, rounds interleaved so that background
load hits them alike; the table shows medians. "other" is wall time minus the time the
profiler saw inside matmul and attention kernels: what compilation and fewer ops remove.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch


from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.app.engine_factory import BuiltEngine, build_engine
from pdserve.metrics import Metrics
from pdserve.api.sampling import SamplingParams
from pdserve.request import GenerationRequest

VARIANTS = {  # name -> (dtype flag, compile)
    "fp32 eager": ("float32", False),
    "fp32 compiled": ("float32", True),
    "quantized eager": ("auto", False),
    "quantized compiled": ("auto", True),
}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "pdserve_cpu::q4_1_linear", "pdserve_cpu::q8_0_linear")
ATTENTION_OPS = ("pdserve_cpu::paged_decode_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::index", "aten::index_put_")


@dataclass
class StepProfile:
    ms_per_step: float  # under the profiler (which adds its own per-op cost)
    matmul_ms: float
    attention_ms: float
    ops_per_step: float


def make(dtype: str, compile_step: bool) -> BuiltEngine:
    config = WorkerConfig(
        model=ModelConfig(device="cpu", dtype=dtype, compile=compile_step),
        cache=CacheConfig(block_size=16, num_blocks=640),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096),
    )
    return build_engine(config, Metrics())


def _start(loop, prompt: list[int], concurrency: int, num_steps: int) -> None:
    for index in range(concurrency):
        request_id = f"c{concurrency}-{index}-{time.monotonic_ns()}"
        loop.submit(GenerationRequest(request_id, tuple(prompt), SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)), lambda o: None)
    loop._drain_inbox(block=False)
    while any(r.num_computed_tokens < len(prompt) for r in loop.scheduler.requests.values()):
        loop.step()


def step_ms(loop, prompt: list[int], concurrency: int, num_steps: int) -> float:
    """Mean wall time of `num_steps` decode steps with `concurrency` requests running."""
    _start(loop, prompt, concurrency, num_steps)
    started = time.perf_counter()
    for _ in range(num_steps):
        loop.step()
    elapsed = (time.perf_counter() - started) / num_steps
    loop.run_until_idle()
    return elapsed * 1000


def profile_steps(loop, prompt: list[int], concurrency: int, num_steps: int) -> StepProfile:
    from torch.profiler import ProfilerActivity, profile

    _start(loop, prompt, concurrency, num_steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(num_steps):
            loop.step()
        wall_ms = (time.perf_counter() - started) * 1000 / num_steps
    loop.run_until_idle()
    events = prof.key_averages()
    ms_in = lambda names: sum(e.self_cpu_time_total for e in events if e.key in names) / 1000 / num_steps  # noqa: E731
    ops = sum(e.count for e in events if e.key.startswith(("aten::", "pdserve_cpu::"))) / num_steps
    return StepProfile(wall_ms, ms_in(MATMUL_OPS), ms_in(ATTENTION_OPS), ops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--concurrency", type=int, action="append", default=None)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), default=None,
                        help="run only these variants (repeatable; default: all)")
    parser.add_argument("--out", default="bench/results/decode_step.json")
    args = parser.parse_args()
    concurrencies = args.concurrency or [1, 16]
    variants = {name: VARIANTS[name] for name in (args.variant or VARIANTS)}
    engines = {name: make(dtype, compile_step) for name, (dtype, compile_step) in variants.items()}
    prompt = list(range(1000, 1180))
    times: dict[str, dict[int, list[float]]] = {name: {c: [] for c in concurrencies} for name in variants}
    for _ in range(args.rounds):  # interleaved so background load hits every variant alike
        for name, engine in engines.items():
            for c in concurrencies:
                times[name][c].append(step_ms(engine.engine.engine_loop, prompt, c, args.steps))
    profiles = {name: {c: profile_steps(engine.engine.engine_loop, prompt, c, args.steps) for c in concurrencies}
                for name, engine in engines.items()}
    print("| variant | c | ms/step (median) | matmul ms | attention ms | other ms | ops/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for name in variants:
        summary[name] = {}
        for c in concurrencies:
            median = statistics.median(times[name][c])
            p = profiles[name][c]
            other_ms = max(0.0, median - p.matmul_ms - p.attention_ms)
            summary[name][c] = {"median_ms": median, "runs_ms": times[name][c], "profiled_ms": p.ms_per_step,
                                "matmul_ms": p.matmul_ms, "attention_ms": p.attention_ms, "other_ms": other_ms,
                                "ops_per_step": p.ops_per_step}
            print(f"| {name} | {c} | {median:.1f} | {p.matmul_ms:.1f} | {p.attention_ms:.1f} | {other_ms:.1f} "
                  f"| {p.ops_per_step:.0f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(), "variants": summary},
                  f, indent=2)
    print(f"wrote {args.out}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
