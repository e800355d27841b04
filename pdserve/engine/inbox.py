"""The engine thread's inbox: what other threads ask of the engine loop, in the order they asked.

Invariant: other threads reach the engine thread only through these commands (the loop applies them
between steps); `wake` is the one way to end the loop's wait early without asking for anything.
Made before the loop so that what reports to it (the offload tier's reads) is built with its wake-up.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from pdserve.engine.emitter import OutputSink
from pdserve.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class Submit:
    request: GenerationRequest
    sink: OutputSink
    arrival_time_s: float


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: Optional[str]  # None: every request


@dataclass(frozen=True, slots=True)
class Call:
    function: Callable[[], None]  # runs on the engine thread; must not block


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = Union[Submit, Abort, Call, Shutdown]


def _nothing() -> None:
    """What `wake` has the engine thread run: the iteration is the point."""


class EngineInbox:
    """A thread-safe queue of commands for the engine thread."""

    def __init__(self) -> None:
        self._commands: queue.Queue[Command] = queue.Queue()

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self._commands.put(Submit(request, sink, time.monotonic()))

    def put(self, command: Command) -> None:
        self._commands.put(command)

    def call_soon(self, function: Callable[[], None]) -> None:
        """Run `function` on the engine thread at its next iteration (it must not block)."""
        self._commands.put(Call(function))

    def wake(self) -> None:
        """Make an idle engine thread run its next iteration now rather than after its wait
        (from any thread, e.g. when a tier load it polls for has a result)."""
        self._commands.put(Call(_nothing))

    def take(self, timeout_s: Optional[float]) -> Optional[Command]:
        """The next command: waits up to `timeout_s` (None: does not wait); None when there is none."""
        try:
            return self._commands.get(block=timeout_s is not None, timeout=timeout_s)
        except queue.Empty:
            return None
