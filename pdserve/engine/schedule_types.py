"""Records passed from the scheduler to the runner and back.

`SchedulerOutput` is the only thing the runner sees of scheduling; the runner
answers with one `SampledToken` per chunk that asked for a sample. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pdserve.api.sampling import SamplingParams, TopLogprobs


@dataclass(slots=True)
class ScheduledChunk:
    """A run of consecutive tokens of one request to compute this step.

    The chunk covers positions [start_position, start_position + len(token_ids)).
    `block_ids` holds one block table per KV group (0 = null block) covering at
    least every position of the chunk; it is a snapshot owned by this record.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: tuple[list[int], ...]
    sample: bool  # the chunk ends at the request's last known token: sample the next one
    sampling: SamplingParams
    num_sampled_so_far: int = 0  # output tokens already produced (seeds stay reproducible)
    num_prompt_tokens: int = 0
    # The request's own token lists (not copies; read during the step only): penalties,
    # grammar replays and prompt logprobs need the history, not just this chunk.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()  # the model's; min_tokens keeps them (and stop_token_ids) from being drawn

    @property
    def suppressed_stop_ids(self) -> tuple[int, ...]:
        """Token ids that may not be drawn yet: while fewer than `min_tokens` tokens are out, EOS (unless
        ignored) and the stop token ids (vLLM). Rows under a grammar are left to the grammar, which
        allows EOS only where the answer is complete."""
        sampling = self.sampling
        if self.num_sampled_so_far >= sampling.min_tokens or sampling.grammar is not None:
            return ()
        eos = () if sampling.ignore_eos else tuple(self.eos_token_ids)
        return tuple(sampling.stop_token_ids) + eos

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens (as opposed to recomputed outputs) this chunk computes."""
        return max(0, min(self.end_position, self.num_prompt_tokens) - self.start_position)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops per-request state
    # Recurrent-state page copies (source, destination) the runner makes, in order, before the
    # forward pass: prefix-cache snapshots of live state pages and restores from them.
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs = ()  # the most likely alternatives, when asked
    failed: bool = False  # no token could be drawn for this row (its logits were not finite)
    failure: str = ""  # why, when not the logits (what the request's error then says)


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions first_position, first_position + 1, ... (one chunk's worth)."""

    request_id: str
    first_position: int  # >= 1: token 0 has no logprob
    entries: tuple[TopLogprobs, ...]  # each: (the prompt token, its logprob) first, then alternatives


@dataclass(slots=True)
class StepResult:
    """What the runner answers for one `SchedulerOutput`."""

    sampled: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    def extend(self, other: "StepResult") -> None:
        self.sampled.extend(other.sampled)
        self.prompt_logprobs.extend(other.prompt_logprobs)
