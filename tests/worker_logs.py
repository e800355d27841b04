"""A failed test shows what its worker processes logged.

A pytest plugin (tests/conftest.py loads it). When a test fails, every object among its fixture
values (looked for inside tuples, lists and dicts too) that has a `log_path` file, a worker or a
proxy started by bench/lib/launch.py, adds a section to the failure report: the log's warnings
and errors, then its last lines. A failure seen once in CI can then be read from CI's output
alone; the log files themselves are gone with the machine.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

TAIL_CHARS = 3000
MAX_ALERT_LINES = 30
ALERT_WORDS = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")


def _with_logs(value: Any, depth: int = 0) -> Iterator[Any]:
    if isinstance(getattr(value, "log_path", None), str):
        yield value
    elif depth < 2 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _with_logs(item, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _with_logs(item, depth + 1)


def log_summary(path: str) -> str:
    """The alerts of a log (the first MAX_ALERT_LINES) and its last TAIL_CHARS characters."""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace")
    alerts = [line for line in text.splitlines() if any(word in line for word in ALERT_WORDS)]
    shown = "\n".join(alerts[:MAX_ALERT_LINES]) or "(none)"
    return f"warnings and errors:\n{shown}\n\nlast lines:\n{text[-TAIL_CHARS:]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001 (pytest's hook signature)
    outcome = yield
    report = outcome.get_result()
    if report.passed or report.skipped or not hasattr(item, "funcargs"):
        return
    seen: set[str] = set()
    for value in item.funcargs.values():
        for owner in _with_logs(value):
            path = owner.log_path
            if path in seen or not os.path.exists(path):
                continue
            seen.add(path)
            name = getattr(owner, "role", None) or getattr(owner, "name", None) or os.path.basename(path)
            report.sections.append((f"log of {name} ({path})", log_summary(path)))
