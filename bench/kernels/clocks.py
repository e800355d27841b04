"""The kernel benches' timing flags, one rule for every mode: `--threads N` and `--clock wall|cpu`.

`--clock cpu` times by the process's CPU time, which leaves out the time other processes held the
core, and so is only meaningful with one thread (with more it adds up every thread's time):
`checked_clock` refuses the pair.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CPU_CLOCK_HELP = "cpu: the process's CPU time (with --threads 1 only), for a shared machine"


def add_timing_arguments(parser: argparse.ArgumentParser, threads: int, clock: str) -> None:
    """`--threads` and `--clock`, with a mode's own defaults."""
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default=clock, help=CPU_CLOCK_HELP)


def checked_clock(args: argparse.Namespace) -> Callable[[], float]:
    """The clock `--clock` names; SystemExit for `--clock cpu` with more than one thread."""
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu adds up every thread's time: use it with --threads 1")
    return CLOCKS[args.clock]
