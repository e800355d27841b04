"""The machine under a benchmark: waiting for a shared machine to go idle before a measured run, how
busy it was with work that is not the benchmark's during one (`CpuMeter`), and what it is.

Invariant: it only ever reads /proc and sleeps; it never waits longer than asked, and the foreign
share counts only CPU time of processes outside the measured set (this process and the servers).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from typing import Iterable, Optional

from bench.lib.launch import REPO_ROOT

logger = logging.getLogger(__name__)

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal; idle and iowait are not busy


def _machine_busy_ticks() -> Optional[int]:
    """Busy jiffies of all CPUs since boot, from /proc/stat; None without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values))


def busy_fraction(interval_s: float, pids: Iterable[int] = ()) -> Optional[float]:
    """Share of all CPUs that processes other than this one and `pids` keep busy over the next `interval_s`."""
    meter = CpuMeter(pids)
    meter.start()
    time.sleep(interval_s)
    return meter.foreign_fraction()


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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far, all its threads; 0 once it is gone."""
    return _process_ticks(pid) / os.sysconf("SC_CLK_TCK")


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
        # Children this process ran to completion meanwhile (a benchmark binary such as llama-bench) are
        # its own work too: their time joins this process's once reaped.
        times = os.times()
        reaped_ticks = round((times.children_user + times.children_system) * self._ticks_per_s)
        return CpuSnapshot(time.monotonic(), _machine_busy_ticks(),
                           sum(_process_ticks(p) for p in self._pids) + reaped_ticks)

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
        fraction = busy_fraction(window_s, pids)
        if fraction is None or fraction < max_foreign_fraction or time.monotonic() >= deadline_s:
            return fraction


def source_state() -> dict:
    """The commit the benchmark ran and the tracked files that differ from it (processes it starts run
    the working tree, not the commit alone); None for either where git cannot tell."""
    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None

    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip() if commit else None,
            "uncommitted_changes": None if status is None else [line[3:] for line in status.splitlines() if line.strip()]}


def machine_info() -> dict:
    """The machine and the source a report came from."""
    cpu_model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": cpu_model, "num_cpus": os.cpu_count(), "python": platform.python_version(),
            "usable_cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "load_average": os.getloadavg()} | source_state()
