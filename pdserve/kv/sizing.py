"""How many bytes of GPU memory the KV pool may take: the sizing rule, as one pure function.

Invariants: the pool never takes memory a step needs (the measured workspace of
the largest step stays free beside it); this worker never holds more than
`utilization` of the GPU at its peak (weights + pool + workspace), whoever else
shares the GPU; and the pool never takes memory that is not free. Torch-free:
the caller measures, this decides.

    GPU memory (total)
    +----------+------------------+-----------+----------------+--------+------------------+
    | others,  | weights          | KV pool   | step workspace | margin | free             |
    | CUDA     | (held = free     |           | (measured peak |        |                  |
    | context  |  before load -   |           |  of the largest|        |                  |
    |          |  free after load)|           |  step)         |        |                  |
    +----------+------------------+-----------+----------------+--------+------------------+
               |<------ share = utilization x total -------->|
               |                  |<------- free after load ---------------------------->|

    pool = min(share - held - workspace,  free after load - workspace - margin)
    margin = 1% of the GPU (kernels loaded lazily later, allocator slack)
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN_FRACTION = 0.01


class InsufficientDeviceMemory(ValueError):
    """The device cannot hold a KV pool next to the weights and the step workspace."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the worker measured on its device, in bytes."""

    total_bytes: int
    free_before_load_bytes: int  # after the CUDA context exists, before the weights
    free_after_load_bytes: int  # after the weights (and the workspace measurement, its cache returned)
    workspace_bytes: int  # peak transient memory of the largest step this configuration allows


@dataclass(frozen=True, slots=True)
class PoolBudget:
    share_bytes: int  # what this worker's share of the GPU leaves for the pool
    free_bytes: int  # what the memory really free leaves for it

    @property
    def pool_bytes(self) -> int:
        return min(self.share_bytes, self.free_bytes)

    @property
    def limited_by_free_memory(self) -> bool:
        """Someone else holds part of this worker's share: the pool is smaller than the share allows."""
        return self.free_bytes < self.share_bytes


def kv_pool_budget(memory: DeviceMemory, utilization: float) -> PoolBudget:
    """The pool's bytes under both limits of the module docstring; raises when there is no room."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    held = max(0, memory.free_before_load_bytes - memory.free_after_load_bytes)
    share = int(memory.total_bytes * utilization) - held - memory.workspace_bytes
    margin = int(memory.total_bytes * MARGIN_FRACTION)
    budget = PoolBudget(share, memory.free_after_load_bytes - memory.workspace_bytes - margin)
    if budget.pool_bytes <= 0:
        raise InsufficientDeviceMemory(
            f"no room for a KV pool: {_gib(memory.total_bytes)} GPU, {_gib(memory.free_after_load_bytes)} free "
            f"after loading {_gib(held)} of weights, {_gib(memory.workspace_bytes)} needed per step, this worker's "
            f"share {_gib(int(memory.total_bytes * utilization))} (--gpu-memory-utilization {utilization}); raise "
            f"the utilization, lower --max-num-batched-tokens / --max-num-running / --max-model-len, or free the GPU"
        )
    return budget


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
