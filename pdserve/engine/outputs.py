"""Turns sampled tokens into text increments and applies stop strings.

Invariant: emitted text never contains a stop string, never a broken UTF-8
sequence, and never text that may still turn out to be the start of a stop
string (it is held back until it cannot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.api.sampling import FinishReason, TopLogprobs
from pdserve.engine.schedule_types import SampledToken
from pdserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.request import Request, RequestOutput


def _held_back_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def continuing_first_text(tokenizer: Tokenizer, token_id: int, stops: tuple[str, ...]) -> str:
    """The text a stream that goes on past its first output token emits for that token: what
    `OutputProcessor.process` gives at token 1 of an unfinished request (an incomplete UTF-8 sequence
    and a possible start of a stop string held back), not what a request finished there flushes.
    P streams it early for D (pdserve/server/first_events.py); the caller knows token 1 ends nothing."""
    text = IncrementalDetokenizer(tokenizer).push([token_id])
    return text[: len(text) - _held_back_length(text, stops)]


@dataclass(slots=True)
class _TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""  # everything decoded so far (stop string cut off once found)
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _TextState] = {}

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, request: Request, token: Optional[SampledToken] = None
                ) -> tuple[RequestOutput, Optional[FinishReason]]:
        """Output for the tokens `request` gained since the last call (`token`: the one sampled this step).

        Returns the output and, when a stop string ended the request, STOP (the
        caller must then finish the request in the scheduler).
        """
        state = self.states.get(request.request_id)
        if state is None:
            state = _TextState(IncrementalDetokenizer(self.tokenizer))
            self.states[request.request_id] = state
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        stop_reason = self._append_text(state, request, new_ids)
        finished = request.finished or stop_reason is not None
        end = len(state.text)
        if not finished:
            end -= _held_back_length(state.text[state.num_emitted_chars :], request.sampling.stop)
        new_text = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = max(state.num_emitted_chars, end)
        state.num_emitted_tokens = len(request.output_token_ids)
        if finished:
            self.forget(request.request_id)
        wants = request.sampling.logprobs and token is not None
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=tuple(new_ids),
            new_text=new_text,
            new_logprobs=(token.logprob,) if wants else (),
            new_top_logprobs=(token.top_logprobs,) if wants and request.sampling.top_logprobs else (),
            prompt_logprobs=self._prompt_logprobs(state, request),
            finished=finished,
            finish_reason=stop_reason or request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            error=request.error if finished else None,
            kv_transfer_params=request.kv_transfer_params if finished else None,
            pd_recomputed=request.pd_recomputed,
        )
        return output, stop_reason

    @staticmethod
    def _prompt_logprobs(state: _TextState, request: Request) -> Optional[tuple[Optional[TopLogprobs], ...]]:
        """Sent once, with the first output: None for the first prompt token, which has no context."""
        if request.sampling.prompt_logprobs is None or state.sent_prompt_logprobs:
            return None
        state.sent_prompt_logprobs = True
        return (None, *request.prompt_logprobs)

    def _append_text(self, state: _TextState, request: Request, new_ids: list[int]) -> Optional[FinishReason]:
        piece = self._decode(state, request, new_ids)
        stops = request.sampling.stop
        if not stops or not piece:
            state.text += piece
            return None
        # A stop string may straddle the old text and the new piece.
        search_from = max(0, len(state.text) - max(len(s) for s in stops) + 1)
        state.text += piece
        hits = [index for index in (state.text.find(s, search_from) for s in stops) if index >= 0]
        if not hits:
            return None
        state.text = state.text[: min(hits)]
        return FinishReason.STOP

    @staticmethod
    def _decode(state: _TextState, request: Request, new_ids: list[int]) -> str:
        # EOS / stop token ids that end the request are not part of the text.
        if request.finished and request.finish_reason is FinishReason.STOP and new_ids:
            last = new_ids[-1]
            if last in request.sampling.stop_token_ids or (not request.sampling.ignore_eos and last in request.eos_token_ids):
                new_ids = new_ids[:-1]
        text = state.detokenizer.push(new_ids) if new_ids else ""
        if request.finished:
            text += state.detokenizer.flush()
        return text
