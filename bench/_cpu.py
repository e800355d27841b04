"""How busy the machine was with work that is not the benchmark's, during one phase.

Invariant: the foreign share counts only CPU time of processes outside the set
being measured (this process and the server under test), so a noisy neighbour
shows up in the results instead of silently skewing a ratio.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal; idle and iowait are not busy


def _machine_busy_ticks() -> Optional[int]:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))


def _process_ticks(pid: int) -> int:
    """utime + stime of one process, all its threads; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces; it ends at the last ')'
    return int(fields[11]) + int(fields[12])


@dataclass(slots=True)
class CpuSnapshot:
    time_s: float
    machine_ticks: Optional[int]
    own_ticks: int


class CpuMeter:
    """Brackets a phase; `foreign_fraction` is the share of all cores other processes used."""

    def __init__(self, pids: Iterable[int]):
        self._pids = [os.getpid(), *pids]
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._num_cpus = os.cpu_count() or 1
        self._start: Optional[CpuSnapshot] = None

    def _snapshot(self) -> CpuSnapshot:
        return CpuSnapshot(time.monotonic(), _machine_busy_ticks(), sum(_process_ticks(p) for p in self._pids))

    def start(self) -> None:
        self._start = self._snapshot()

    def foreign_fraction(self) -> Optional[float]:
        """Fraction of the machine's CPU capacity since `start()` spent outside the measured processes."""
        end = self._snapshot()
        if self._start is None or end.machine_ticks is None or self._start.machine_ticks is None:
            return None
        elapsed_ticks = (end.time_s - self._start.time_s) * self._ticks_per_s * self._num_cpus
        if elapsed_ticks <= 0:
            return None
        foreign_ticks = (end.machine_ticks - self._start.machine_ticks) - (end.own_ticks - self._start.own_ticks)
        return min(1.0, max(0.0, foreign_ticks / elapsed_ticks))


def wait_for_quiet(pids: Iterable[int], max_foreign_fraction: float, max_wait_s: float,
                   window_s: float = 1.0) -> Optional[float]:
    """Waits (at most `max_wait_s`) for a `window_s` window in which other processes use less than
    `max_foreign_fraction` of the CPUs; returns the last window's fraction, None where unknown."""
    pids = list(pids)
    deadline_s = time.monotonic() + max_wait_s
    while True:
        meter = CpuMeter(pids)
        meter.start()
        time.sleep(window_s)
        fraction = meter.foreign_fraction()
        if fraction is None or fraction < max_foreign_fraction or time.monotonic() >= deadline_s:
            return fraction
