"""Tests leave nothing behind: at the end of the session, any process a test started that is still
alive fails the run (and is killed, so it cannot outlive the run either).

A pytest plugin (tests/conftest.py loads it): it walks this process's descendants in /proc, so it
sees grandchildren too (the workers `pdserve up` starts). Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

GRACE_S = 5.0  # processes told to stop just before the session ended get this long to go


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if state not in ("Z", "X"):  # exited (unreaped) processes are not alive
            children.setdefault(int(ppid), []).append(int(entry.name))
    return children


def living_descendants(pid: int) -> list[int]:
    children = _children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not Path("/proc/self/stat").exists():
        return
    deadline = time.monotonic() + GRACE_S
    while (left := living_descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left:
        return
    lines = [f"  pid {pid}: {_command_line(pid)[:200]}" for pid in left]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "processes started by the tests are still alive at the end of the session (killed now):\n"
    if reporter is not None:
        reporter.write_line(message + "\n".join(lines), red=True)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
