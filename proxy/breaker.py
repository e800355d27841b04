"""Circuit breaker of one backend: closed, open after N consecutive failures, half-open after a cool-down.

Invariant: while open no request is let through; while half-open exactly one
trial request is in flight at a time, and its outcome alone decides whether
the breaker closes or opens for another cool-down (requests sent before the
breaker opened change nothing when they end). Only backend faults count as
failures; what the request itself caused is neutral (see proxy/legs.py).
"""

from __future__ import annotations

import enum
import time
from typing import Callable


class BreakerState(enum.IntEnum):
    # Values are what the metrics gauge reports.
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failure_threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._num_consecutive_failures = 0
        self._opened_at_s: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at_s is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at_s >= self._cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    @property
    def num_consecutive_failures(self) -> int:
        return self._num_consecutive_failures

    def allows_request(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_request_start(self) -> bool:
        """Call when a request the breaker allows is actually sent; True when it is the half-open trial
        (pass that to the `record_*` call of its outcome)."""
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def record_success(self, trial: bool = False) -> None:
        if trial or self._opened_at_s is None:
            self._num_consecutive_failures = 0
            self._opened_at_s = None
            self._trial_in_flight = False

    def record_failure(self, trial: bool = False) -> None:
        if trial:
            self._trial_in_flight = False
            self._opened_at_s = self._clock()  # the trial failed: another full cool-down
        elif self._opened_at_s is None:
            self._num_consecutive_failures += 1
            if self._num_consecutive_failures >= self._failure_threshold:
                self._opened_at_s = self._clock()

    def record_neutral(self, trial: bool = False) -> None:
        """A request ended without telling anything about the backend (client gone, its own fault)."""
        if trial:
            self._trial_in_flight = False
