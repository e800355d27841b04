"""What a request asks the engine for (`SamplingParams`) and how it ended (`FinishReason`).

Torch-free, frozen records: the HTTP edge builds them from the OpenAI schema, the
engine reads them; they carry nothing of the engine's own state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or context limit
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"  # the engine could not serve it (e.g. failed KV pull under policy `fail`)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # return the log-probability of each sampled token
    top_logprobs: int = 0  # and of this many most likely alternatives
    prompt_logprobs: Optional[int] = None  # log-probabilities of the prompt's tokens (with alternatives)
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF: logits of prompt and generated tokens divided (>0) or multiplied (<0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: Optional[str] = None  # llguidance grammar the output must match (pdserve/grammar/)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# The most likely tokens at one position, most likely first: ((token id, logprob), ...).
# For a prompt token the token itself comes first, then the alternatives.
TopLogprobs = tuple[tuple[int, float], ...]
