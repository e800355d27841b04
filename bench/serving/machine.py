"""Waits for a shared machine to go idle before a measured run, so that other jobs' CPU use
does not land on one system of a comparison and not on the other.

Invariant: it only ever reads /proc/stat and sleeps; it never waits longer than
asked, and reports whether the machine really was idle when it returned.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

logger = logging.getLogger(__name__)

_IDLE_FIELDS = (3, 4)  # idle and iowait, after the "cpu" label


def _cpu_ticks() -> Optional[tuple[int, int]]:
    """(total, idle) jiffies of all CPUs since boot; None without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values), sum(values[i] for i in _IDLE_FIELDS if i < len(values))


def busy_fraction(interval_s: float) -> Optional[float]:
    """Share of all CPUs busy over the next `interval_s` seconds."""
    before = _cpu_ticks()
    time.sleep(interval_s)
    after = _cpu_ticks()
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1.0 - (after[1] - before[1]) / (after[0] - before[0])


def wait_for_idle(max_wait_s: float, max_busy_fraction: float = 0.1, quiet_s: float = 30.0,
                  sample_s: float = 5.0) -> bool:
    """Returns once the machine stayed under `max_busy_fraction` busy for `quiet_s` in a row (True),
    or after `max_wait_s` (False)."""
    deadline_s = time.monotonic() + max_wait_s
    quiet_since_s: Optional[float] = None
    while time.monotonic() < deadline_s:
        busy = busy_fraction(sample_s)
        if busy is None:
            return False
        now_s = time.monotonic()
        quiet_since_s = (quiet_since_s or now_s - sample_s) if busy <= max_busy_fraction else None
        if quiet_since_s is not None and now_s - quiet_since_s >= quiet_s:
            return True
    logger.warning("the machine did not go idle within %.0f s; measuring anyway", max_wait_s)
    return False
