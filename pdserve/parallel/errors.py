"""The one error that says a tensor-parallel worker lost a rank; torch-free, so the engine loop can
catch it without loading the process group (pdserve/parallel/ranks.py raises it)."""

from __future__ import annotations

from pdserve.api.errors import PdserveError


class RanksLost(PdserveError):
    """A collective failed or timed out: some rank of this worker is gone, so the worker cannot serve."""
