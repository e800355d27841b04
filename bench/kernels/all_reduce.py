"""The shared segment's all-reduce between two processes: native code against Python, in turns.

Two processes (this one and a spawned child) map one segment (pdserve.parallel.host_segment) and
all-reduce a [rows, hidden] float32 tensor `--iterations` times in a loop, each rank on one thread:
once through HostCollectives' Python path, once through its native exchange
(pdserve/kernels/host_exchange.cpp), `--rounds` times in turn. Reported: microseconds per all-reduce
(the median round) for each path, and the ratio. A rank's decode step makes two of these a layer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from bench.lib.report import markdown_table


def _loop(collectives, tensor: torch.Tensor, iterations: int) -> float:  # noqa: ANN001
    collectives.all_reduce(tensor)  # both ranks are here: the loop starts together
    started_s = time.perf_counter()
    for _ in range(iterations):
        collectives.all_reduce(tensor)
    return (time.perf_counter() - started_s) / iterations


def _follower(invites, plan: list[tuple[bool, int]], shape: tuple[int, int]) -> None:  # noqa: ANN001
    from pdserve.parallel.host_collectives import HostCollectives
    from pdserve.parallel.host_segment import open_segment

    torch.set_num_threads(1)
    for invite, (native, iterations) in zip(invites, plan):  # a segment per pass: flags start at 0
        collectives = HostCollectives(open_segment(invite, 1), timeout_s=60)
        if native and not collectives.use_native():
            raise SystemExit("no native kernels in the follower")
        _loop(collectives, torch.ones(shape), iterations)
        collectives.exchange_bytes(b"", 0, "the end of a pass")


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--rows", type=int, default=1, help="rows of the tensor (a decode batch)")
    parser.add_argument("--hidden", type=int, default=576, help="its width (SmolLM2's hidden size)")
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)


def run(args: argparse.Namespace) -> tuple[str, dict]:
    from pdserve.parallel.host_collectives import HostCollectives, shared_memory_check
    from pdserve.parallel.host_segment import create_segment, unlink_segment

    if shared_memory_check(torch.device("cpu")) is not None:
        raise SystemExit(shared_memory_check(torch.device("cpu")))
    torch.set_num_threads(1)
    shape = (args.rows, args.hidden)
    plan = [(native, args.iterations) for _ in range(args.rounds) for native in (False, True)]
    segments = [create_segment(2, 2 << 20) for _ in plan]
    child = multiprocessing.get_context("spawn").Process(
        target=_follower, args=([invite for _, invite in segments], plan, shape))
    child.start()
    seconds: dict[str, list[float]] = {"Python": [], "native": []}
    try:
        for (segment, _), (native, iterations) in zip(segments, plan):
            collectives = HostCollectives(segment, timeout_s=60)
            if native and not collectives.use_native():
                raise SystemExit("no native kernels here")
            seconds["native" if native else "Python"].append(_loop(collectives, torch.ones(shape), iterations))
            collectives.exchange_bytes(b"", 0, "the end of a pass")
    finally:
        child.join(120)
        for _, invite in segments:
            unlink_segment(invite.path)
    median_us = {path: statistics.median(values) * 1e6 for path, values in seconds.items()}
    rows = [[path, " / ".join(f"{value * 1e6:.1f}" for value in seconds[path]), f"{median_us[path]:.1f}",
             f"{median_us['Python'] / median_us[path]:.2f}x"] for path in ("Python", "native")]
    table = markdown_table([f"all-reduce of {args.rows} x {args.hidden} float32", "us per call, per round",
                            "median us", "speed vs Python"], rows)
    return table, {"seconds_per_call": seconds, "median_us": median_us, "child_exit_code": child.exitcode}
