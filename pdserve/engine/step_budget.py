"""How many tokens a step may take while streams are decoding: as many as fit in the promised
time per output token, from the worker's own measured step times.

Invariant: with no `max_step_s`, or nothing decoding, or too few measurements, the budget is the
configured `max_num_batched_tokens` (today's behaviour); otherwise it is the tokens the step-time
model says fit in `max_step_s`, never fewer than every decoding request's one token plus a
minimal prefill chunk (a prompt always progresses), never more than the configured budget.

    step time ~ base + per_token * tokens      fitted over recent steps, older ones forgotten
    budget    = (max_step_s - base) / per_token

A worker that prefills a prompt next to running streams (a colocated worker, or a decode worker
computing a prompt itself) thereby cuts the prompt into chunks the streams barely notice, instead
of one 512-token step that stalls them for hundreds of milliseconds. Torch-free.
"""

from __future__ import annotations

from typing import Optional

MIN_PREFILL_CHUNK = 16
_FORGET = 0.95  # weight of the past at each new step
_MIN_STEPS = 8


class StepTimeModel:
    """A least-squares line through (tokens, seconds) of recent steps, exponentially weighted."""

    def __init__(self) -> None:
        self.num_steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0:
            return
        self._w = _FORGET * self._w + 1
        self._x = _FORGET * self._x + num_tokens
        self._y = _FORGET * self._y + seconds
        self._xx = _FORGET * self._xx + num_tokens * num_tokens
        self._xy = _FORGET * self._xy + num_tokens * seconds
        self.num_steps += 1

    def line(self) -> Optional[tuple[float, float]]:
        """(base seconds, seconds per token), or None before enough steps. With steps of one size
        only the slope cannot be told from the base: all of the time is put on the tokens."""
        if self.num_steps < _MIN_STEPS:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance <= 1e-9 * max(1.0, mean_x * mean_x):
            return 0.0, mean_y / mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / variance
        if slope <= 0:
            return 0.0, mean_y / mean_x
        return max(0.0, mean_y - slope * mean_x), slope


class StepBudget:
    def __init__(self, max_num_batched_tokens: int, max_step_s: Optional[float]):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_step_s = max_step_s
        self.model = StepTimeModel()

    def tokens(self, num_decoding: int) -> int:
        """This step's token budget with `num_decoding` requests generating (see the module docstring)."""
        line = self.model.line() if self.max_step_s is not None and num_decoding > 0 else None
        if line is None:
            return self.max_num_batched_tokens
        base_s, per_token_s = line
        fitting = int((self.max_step_s - base_s) / per_token_s)
        return max(num_decoding + MIN_PREFILL_CHUNK, min(fitting, self.max_num_batched_tokens))
