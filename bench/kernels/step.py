"""Decode-step time of the in-process engine on the embedded model, by variant or layer kernel.

`step` splits each variant's step (fp32 or quantized, eager or compiled) into matmuls, attention
and the rest; `fused-layer` times one native call per layer (the CPU default) against the per-op
step it replaces.

`step`: "other" is wall time less what the profiler saw inside matmul and attention kernels, what
compilation and fewer ops remove. `fused-layer`: both variants share one engine. A step is the
mean over `--steps` decode steps (schedule, forward, sampling); tables show medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.lib.report import markdown_table
from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.app.engine_factory import BuiltEngine, build_engine
from pdserve.metrics import Metrics
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
PROMPT = list(range(1000, 1180))


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--rounds", type=int, default=3 if mode == "step" else 5)
    parser.add_argument("--steps", type=int, default=16)
    if mode == "step":
        parser.add_argument("--concurrency", type=int, action="append", default=None, help="repeatable; default 1, 16")
        parser.add_argument("--variant", action="append", choices=list(VARIANTS), default=None,
                            help="run only these variants (repeatable; default: all)")
    else:
        parser.add_argument("--concurrency", type=int, default=1)
        parser.add_argument("--dtype", default="auto", help="auto: the GGUF's blocks; float32: the exact mode")


def make(dtype: str, compile_step: bool) -> BuiltEngine:
    config = WorkerConfig(
        model=ModelConfig(device="cpu", dtype=dtype, compile=compile_step),
        cache=CacheConfig(block_size=16, num_blocks=640),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096),
    )
    return build_engine(config, Metrics())


def _start(loop, concurrency: int, num_steps: int) -> None:
    sampling = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for index in range(concurrency):
        request_id = f"c{concurrency}-{index}-{time.monotonic_ns()}"
        loop.submit(GenerationRequest(request_id, tuple(PROMPT), sampling), lambda o: None)
    loop._drain_inbox(block=False)
    while any(r.num_computed_tokens < len(PROMPT) for r in loop.scheduler.requests.values()):
        loop.step()


def step_ms(loop, concurrency: int, num_steps: int) -> float:
    """Mean wall time of `num_steps` decode steps with `concurrency` requests running."""
    _start(loop, concurrency, num_steps)
    started = time.perf_counter()
    for _ in range(num_steps):
        loop.step()
    elapsed = (time.perf_counter() - started) / num_steps
    loop.run_until_idle()
    return elapsed * 1000


def profile_steps(loop, concurrency: int, num_steps: int) -> dict[str, float]:
    """Matmul and attention ms per step as the profiler sees them, and ops per step."""
    from torch.profiler import ProfilerActivity, profile

    _start(loop, concurrency, num_steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            loop.step()
    loop.run_until_idle()
    events = prof.key_averages()
    ms_in = lambda names: sum(e.self_cpu_time_total for e in events if e.key in names) / 1000 / num_steps  # noqa: E731
    ops = sum(e.count for e in events if e.key.startswith(("aten::", "pdserve_cpu::"))) / num_steps
    return {"matmul_ms": ms_in(MATMUL_OPS), "attention_ms": ms_in(ATTENTION_OPS), "ops_per_step": ops}


def run_variants(args: argparse.Namespace) -> tuple[str, dict]:
    """`step`: every variant at every concurrency, rounds interleaved, then one profiled pass each."""
    concurrencies = args.concurrency or [1, 16]
    engines = {name: make(*VARIANTS[name]) for name in (args.variant or VARIANTS)}
    times = {name: {c: [] for c in concurrencies} for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for c in concurrencies:
                times[name][c].append(step_ms(engine.engine.engine_loop, c, args.steps))
    summary, rows = {}, []
    for name, engine in engines.items():
        for c in concurrencies:
            median = statistics.median(times[name][c])
            p = profile_steps(engine.engine.engine_loop, c, args.steps)
            other_ms = max(0.0, median - p["matmul_ms"] - p["attention_ms"])
            summary.setdefault(name, {})[c] = p | {"median_ms": median, "runs_ms": times[name][c], "other_ms": other_ms}
            rows.append((name, c, f"{median:.1f}", f"{p['matmul_ms']:.1f}", f"{p['attention_ms']:.1f}",
                         f"{other_ms:.1f}", f"{p['ops_per_step']:.0f}"))
    table = markdown_table(["variant", "c", "ms/step (median)", "matmul ms", "attention ms", "other ms", "ops/step"],
                           rows)
    return table, {"torch_threads": torch.get_num_threads(), "variants": summary}


def run_fused(args: argparse.Namespace) -> tuple[str, dict]:
    """`fused-layer`: one engine, its decode step with and without the fused layer, rounds alternating."""
    built = make(args.dtype, False)
    loop = built.engine.engine_loop
    decode_step = loop.runner.decode_step
    fused = decode_step._fused
    if fused is None:
        raise SystemExit("this model or machine does not take the fused layer (no native kernels?)")
    samples: dict[str, list[float]] = {"fused (one call a layer)": [], "per-op": []}
    with torch.inference_mode():
        step_ms(loop, args.concurrency, 4)  # warm-up
        for _ in range(args.rounds):
            for name in samples:
                decode_step._fused = fused if name.startswith("fused") else None
                samples[name].append(step_ms(loop, args.concurrency, args.steps))
    decode_step._fused = fused
    built.close()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratio = medians["per-op"] / medians["fused (one call a layer)"]
    table = markdown_table([f"variant ({args.dtype}, c={args.concurrency})", f"ms per step (median of {args.rounds})"],
                           [(name, f"{value:.1f}") for name, value in medians.items()])
    return f"{table}\nfused is {ratio:.2f}x the per-op step", {"samples_ms": samples, "medians_ms": medians,
                                                               "speedup": ratio}
