"""The peer-pull decision: pull a prefix from a peer only when this worker's own measurements predict
the pull is faster than computing it, and never below `--peer-pull-min-tokens`.

Invariant: a prediction is always defined (seeded with conservative defaults until this worker measured
anything), depends only on what this worker measured itself, and changes only by an observation
(exponentially weighted: recent steps and pulls count most). Torch-free; observations come from the
engine thread (prefill steps, landed pulls), questions from the async side (a float read is atomic, a
stale one harmless).

    predicted compute of N tokens = compute_s_per_token * N            (prefill steps: seconds / prompt tokens)
    predicted pull of N tokens    = pin_s + pull_s_per_token * N       (pin round trip; READ, queueing included)

    pull  iff  N >= min_tokens  and  predicted pull < predicted compute
    crossover N* = pin_s / (compute_s_per_token - pull_s_per_token)    (none when the READ is no faster)

A price that says "compute" is never re-measured by pulls that are not made: every `probe_every`-th
hint judged costlier is followed anyway (a probe), so a pull price raised by a passing cause (a busy
peer, a slow network for a while) comes back down once pulls are fast again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Seeds until measured: a GPU prefill of a small model, a NIXL READ of its pages between two processes on one
# host, an HTTP pin round trip. Crossover at 62 tokens, near the floor's default (64).
DEFAULT_COMPUTE_S_PER_TOKEN = 1e-4
DEFAULT_PULL_S_PER_TOKEN = 2e-5
DEFAULT_PIN_S = 5e-3
# A step with fewer prompt tokens than this is mostly fixed cost (launches, the decode rows beside it): not
# a measure of the per-token price of a prefill.
MIN_MEASURED_PREFILL_TOKENS = 32
DEFAULT_PROBE_EVERY = 16


@dataclass(slots=True)
class PullVerdict:
    """Whether to pull `num_tokens` from a peer, and why (for the log line of a hint not followed)."""

    pull: bool
    reason: str
    result: str = ""  # the counter's label when not pulled: skipped (under the floor), costlier (predicted slower)


class PeerPullCosts:
    """This worker's own prices of computing and of pulling prompt tokens, and the decision from them.

    `measured=False` keeps only the floor (`--peer-pull-decision threshold`): every hint at or above
    `min_tokens` is followed."""

    def __init__(self, min_tokens: int = 1, measured: bool = True, weight: float = 0.2,
                 compute_s_per_token: float = DEFAULT_COMPUTE_S_PER_TOKEN,
                 pull_s_per_token: float = DEFAULT_PULL_S_PER_TOKEN, pin_s: float = DEFAULT_PIN_S,
                 probe_every: int = DEFAULT_PROBE_EVERY):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must lie in (0, 1], got {weight}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}")
        self.min_tokens = max(min_tokens, 1)
        self.measured = measured
        self.weight = weight
        self.compute_s_per_token = compute_s_per_token
        self.pull_s_per_token = pull_s_per_token
        self.pin_s = pin_s
        self.probe_every = probe_every
        self.num_prefill_observations = 0
        self.num_pull_observations = 0
        self._num_costlier_since_probe = 0

    # ---- observations ------------------------------------------------------------------------

    def observe_prefill(self, num_prompt_tokens: int, duration_s: float) -> None:
        """An engine step that computed `num_prompt_tokens` prompt tokens in `duration_s`."""
        if num_prompt_tokens < MIN_MEASURED_PREFILL_TOKENS or duration_s <= 0:
            return
        self.compute_s_per_token = self._blend(self.compute_s_per_token, duration_s / num_prompt_tokens)
        self.num_prefill_observations += 1

    def observe_pull(self, num_tokens: int, duration_s: float) -> None:
        """A peer pull of `num_tokens` that landed `duration_s` after the peer's pin answer."""
        if num_tokens <= 0 or duration_s <= 0:
            return
        self.pull_s_per_token = self._blend(self.pull_s_per_token, duration_s / num_tokens)
        self.num_pull_observations += 1

    def observe_pin(self, duration_s: float) -> None:
        """A pin round trip (asked to answered), whether or not the pull was then used."""
        if duration_s > 0:
            self.pin_s = self._blend(self.pin_s, duration_s)

    def _blend(self, old: float, new: float) -> float:
        return (1.0 - self.weight) * old + self.weight * new

    # ---- predictions and the decision ---------------------------------------------------------

    def predicted_compute_s(self, num_tokens: int) -> float:
        return self.compute_s_per_token * num_tokens

    def predicted_pull_s(self, num_tokens: int) -> float:
        return self.pin_s + self.pull_s_per_token * num_tokens

    @property
    def crossover_tokens(self) -> Optional[float]:
        """The prefix length from which pulling is predicted faster; None when a READ is no faster per token."""
        saved_s_per_token = self.compute_s_per_token - self.pull_s_per_token
        return self.pin_s / saved_s_per_token if saved_s_per_token > 0 else None

    def describe(self, num_tokens: int) -> str:
        """The two predictions for `num_tokens`, for a log line (no side effect)."""
        return (f"predicted pull {self.predicted_pull_s(num_tokens) * 1e3:.2f} ms, compute "
                f"{self.predicted_compute_s(num_tokens) * 1e3:.2f} ms for {num_tokens} tokens")

    def verdict(self, num_tokens: int) -> PullVerdict:
        """Whether to follow a hint of `num_tokens`; counts costlier verdicts towards the next probe."""
        if num_tokens < self.min_tokens:
            return PullVerdict(False, f"{num_tokens} tokens, under --peer-pull-min-tokens {self.min_tokens}",
                               "skipped")
        if not self.measured:
            return PullVerdict(True, "at or above --peer-pull-min-tokens")
        comparison = self.describe(num_tokens)
        if self.predicted_pull_s(num_tokens) < self.predicted_compute_s(num_tokens):
            return PullVerdict(True, comparison)
        self._num_costlier_since_probe += 1
        if self._num_costlier_since_probe >= self.probe_every:
            self._num_costlier_since_probe = 0
            return PullVerdict(True, comparison + f", pulled anyway to measure again (1 in {self.probe_every})")
        return PullVerdict(False, comparison + " (measured here: docs/operations.md, peer pulls)", "costlier")
