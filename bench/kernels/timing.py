"""Wall-clock timing shared by the micro-benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def mean_ms(work: Callable[[], None], repeats: int) -> float:
    """Milliseconds per call of `work`, over `repeats` calls in a row."""
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - started) / repeats * 1000


def median_ms(work: Callable[[], None], repeats: int, rounds: int) -> float:
    """The median over `rounds` of `mean_ms`, after one untimed call (lazy set-up, caches)."""
    work()
    return statistics.median(mean_ms(work, repeats) for _ in range(rounds))
