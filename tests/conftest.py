"""Fixtures and session checks shared by every test package."""

from __future__ import annotations

from tests.process_guard import pytest_sessionfinish  # noqa: F401 - the hook: no test may leave a process behind
