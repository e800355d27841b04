"""A tensor-parallel rank's decode step against the whole model's, compute alone.

bench.tensor_parallel's random Llama (12 layers, hidden 576), loaded whole (TP=1, the fused stack)
and as rank 0 of `--size` with the collectives replaced by the identity; the rank's step runs its
layers per-op (torch ops, as ranks did before 2026-11-28) and fused (two native calls a layer,
around its all-reduces). Engine decode steps at each batch, ms a step (the fastest of `--rounds`
decode runs less a prefill-only run). The wall-clock TP bench needs a quiet machine; with
`--threads 1 --clock cpu` this one leaves out the time other processes held the core.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from bench.lib.engine_rounds import decode_seconds
from bench.kernels.clocks import add_timing_arguments, checked_clock
from bench.lib.report import markdown_table



def step_ms(loaded, batch: int, new_tokens: int, fused: bool, rounds: int, clock) -> float:
    from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from pdserve.app.engine_factory import build_engine
    from pdserve.metrics import Metrics
    from pdserve.runner.decode_step import DecodeStep

    worker = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=64 + batch * 8, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_running=batch))
    loop = build_engine(worker, Metrics(), loaded).engine.engine_loop
    step = loop.runner.decode_step
    if not fused:
        loop.runner.decode_step = DecodeStep(step.model, step.plan, step.pool, step.layer_caches, step.block_size,
                                             step.device, compile_step=False, fuse_layers=False)
    elif step._fused_stack is None:
        raise SystemExit("the decode step does not run the fused stack here")

    prompts = [tuple(3 + (7 * b + j) % 4000 for j in range(32)) for b in range(batch)]
    decode_s = decode_seconds(loop, prompts, new_tokens, rounds, clock)
    return min(s for s in decode_s) / new_tokens * 1e3


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--size", type=int, default=2, help="ranks the model is cut for (rank 0 is measured)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    add_timing_arguments(parser, threads=1, clock="cpu")


def run(args: argparse.Namespace) -> tuple[str, dict]:
    from bench.tensor_parallel import ModelShape, build_checkpoint
    from pdserve.models.loader import load_model
    from pdserve.models.registry import TensorParallelRank

    clock = checked_clock(args)
    torch.set_num_threads(args.threads)
    directory = build_checkpoint(tempfile.mkdtemp(prefix="tp-rank-"), ModelShape(), seed=0)
    same = lambda tensor: tensor  # noqa: E731 - a rank's partials stand for their sum
    whole = load_model(directory, torch.float32, torch.device("cpu"))
    rank = load_model(directory, torch.float32, torch.device("cpu"),
                      parallel=TensorParallelRank(0, args.size, same, same))
    cases = {"TP=1, fused": (whole, True), f"rank 0 of {args.size}, per-op": (rank, False),
             f"rank 0 of {args.size}, fused": (rank, True)}
    rows = [{"case": name, "batch": batch,
             "step_ms": round(step_ms(loaded, batch, args.new_tokens, fused, args.rounds, clock), 3)}
            for name, (loaded, fused) in cases.items() for batch in args.batches]
    per_op = {r["batch"]: r["step_ms"] for r in rows if r["case"].endswith("per-op")}
    for row in rows:
        row["per_op_over_this"] = round(per_op[row["batch"]] / row["step_ms"], 2)
    table = markdown_table(["case", "batch", "ms a step", "rank per-op / this"],
                           [(r["case"], r["batch"], r["step_ms"], r["per_op_over_this"]) for r in rows])
    return table, {"rows": rows}
