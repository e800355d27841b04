"""UCX settings pdserve makes before its NIXL agent creates a UCX context."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def allow_cuda_ipc_reads() -> None:
    """Let UCX serve a READ of another process's GPU pages with cuda_ipc on any GPU link.

    UCX enables cuda_ipc's get (what a decode worker's pull is) only where it detects
    NVLink. Without it, a pull between two processes on one PCIe GPU fell back to TCP over
    loopback: 0.46 GB/s on an H100, against 280-370 GB/s with cuda_ipc reads allowed
    (docs/benchmarks.md, "GPU"). Set before the agent creates its UCX context; an operator's
    own value wins."""
    if os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y") == "y":
        logger.info("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: GPU pages are read over cuda_ipc on any link")
