"""Builds pdserve's native CPU kernels once, before any test starts a worker process, so that
workers find them cached instead of each compiling them (racing, and eating their start-up
timeout on a busy machine). A machine that cannot build them logs why and runs the torch paths."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def pytest_sessionstart(session) -> None:  # noqa: ANN001 (pytest's hook signature)
    from pdserve.kernels import native

    reason = native.cpu_kernels_error()
    if reason is not None:
        logger.warning("native CPU kernels unavailable for this run: %s", reason)
