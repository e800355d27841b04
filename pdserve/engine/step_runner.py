"""What the engine loop asks of whatever runs its steps on a device: the `StepRunner` contract.

The loop and the scheduler never import the runner (pdserve/runner/, torch); they see this protocol
only, so they load without torch and a test runs the loop over a recording double.
Invariant: after `synchronize()` returns, no kernel of a step is still running, so the loop may let
the scheduler free, evict, publish or reuse any block.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from pdserve.engine.schedule_types import SchedulerOutput, StepResult


class StepCancelled(Exception):
    """The step was abandoned between layers: every request in it was aborted meanwhile."""


class StepRunner(Protocol):
    """Runs one `SchedulerOutput` (the only thing it sees of the scheduler) and samples its tokens."""

    # Whether a step may be abandoned between layers (`StepCancelled`); tensor-parallel rank 0 may not:
    # its other ranks would wait in the next layer's collective.
    cancellable: bool
    # Set by the loop for the step about to run (cancellable runners only): True once its requests are
    # all aborted. None: nothing to check.
    stop_check: Optional[Callable[[], bool]]
    # Whether a failed step's chunks may be run again one by one: False where a step advances state
    # in place (recurrent-state layers), so a step that failed half-way left some of it advanced and a
    # replay would compute from the wrong state; the loop then fails the whole step.
    replays_failed_steps: bool

    def bind_thread(self) -> None:
        """Called once on the engine thread before its first step (a CUDA runner makes its device current)."""

    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run the step's chunks and return one sampled token per chunk that asked for one."""

    def synchronize(self) -> None:
        """Block until every kernel this runner queued has finished (a no-op where work is synchronous)."""

    def keep_ranks_alive(self) -> None:
        """Called every loop turn; tensor-parallel rank 0 heartbeats its other ranks here."""
