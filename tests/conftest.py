"""Fixtures and session checks shared by every test package."""

from __future__ import annotations

import pytest

from tests.devices import device_params
from tests.process_guard import pytest_sessionfinish  # noqa: F401 - the hook: no test may leave a process behind


@pytest.fixture(scope="session", params=device_params())
def device(request) -> str:
    """The device a test runs on: "cpu" in CI, also "cuda" where there is a GPU."""
    return request.param
