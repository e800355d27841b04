"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from tests.devices import device_params


@pytest.fixture(scope="session", params=device_params())
def device(request) -> str:
    """The device a test runs on: "cpu" in CI, also "cuda" where there is a GPU."""
    return request.param
