"""Build OpenAI response bodies and stream chunks from engine outputs: the completions format and what both share.

The routes and the SSE writer only talk to the `ResponseFormat` protocol, so
completions and chat share one serving path and differ only here and in
`chat_formatting.py`. Every choice keeps its own streaming state (text
offsets, echo sent), keyed by its index. Logprobs follow vLLM: the sampled
token's log-probability under the model's own distribution, with the top-k
alternatives when asked; completions' `top_logprobs` dicts hold the sampled
token and its alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from pydantic import BaseModel

from pdserve.api.kv_transfer import RemotePrefillParams
from pdserve.api.protocol import (CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo,
                                  openai_finish_reason)
from pdserve.api.sampling import TopLogprobs
from pdserve.request import RequestOutput
from pdserve.server.generation import GenerationResult, usage_info


class ResponseFormat(Protocol):
    def final_response(self, results: Sequence[GenerationResult], usage: UsageInfo) -> BaseModel:
        """The whole answer of a non-streaming request (results in choice order)."""
        ...

    def opening_chunks(self) -> list[BaseModel]:
        """Chunks sent before the first output (chat announces the assistant role of each choice)."""
        ...

    def output_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        """Chunks carrying one engine output of choice `index`; empty when it adds nothing visible."""
        ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        ...


def token_strings(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in token_ids]


def results_usage(results: Sequence[GenerationResult], prompt_lengths: Sequence[int], num_choices: int) -> UsageInfo:
    """Every prompt counted once, every choice's tokens counted (OpenAI's usage for n > 1 and batches);
    cached tokens are the prompts' leaders' (siblings reuse what their leader computed)."""
    return usage_info(sum(prompt_lengths), sum(len(result.token_ids) for result in results),
                      sum(result.num_cached_tokens for result in results[::num_choices]))


def wire_params(params: Optional[RemotePrefillParams]) -> Optional[dict]:
    return None if params is None else params.to_wire()


@dataclass(slots=True)
class _LogprobRows:
    """Completions' logprobs as parallel lists."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[Optional[float]] = field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token: str, logprob: Optional[float], top: Optional[dict[str, float]], offset: int) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def to_wire(self, with_top: bool) -> CompletionLogprobs:
        return CompletionLogprobs(tokens=self.tokens, token_logprobs=self.token_logprobs,
                                  top_logprobs=self.top_logprobs if with_top else None, text_offset=self.text_offset)


@dataclass(slots=True)
class CompletionFormat:
    response_id: str
    model: str
    created: int
    tokenizer: Any
    with_logprobs: bool
    num_top_logprobs: int = 0
    echo: bool = False
    prompts: tuple[tuple[int, ...], ...] = ()  # token ids per prompt (echo)
    prompt_texts: tuple[str, ...] = ()  # the prompts as text (echo)
    num_choices: int = 1  # per prompt
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: text length sent so far
    _prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # per prompt, from its leader

    def final_response(self, results: Sequence[GenerationResult], usage: UsageInfo) -> BaseModel:
        choices = []
        for index, result in enumerate(results):
            prompt_index = index // self.num_choices
            if result.prompt_logprobs is not None:
                self._prompt_logprobs[prompt_index] = result.prompt_logprobs
            text, rows = self._echo(prompt_index) if self.echo else ("", _LogprobRows())
            offset = len(text)
            self._add_tokens(rows, result.token_ids, result.logprobs, result.top_logprobs, offset)
            choices.append(CompletionChoice(
                index=index, text=text + result.text,
                logprobs=rows.to_wire(self.num_top_logprobs > 0) if self.with_logprobs else None,
                finish_reason=openai_finish_reason(result.finish_reason),
            ))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage, kv_transfer_params=wire_params(results[0].kv_transfer_params))

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def output_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        prompt_index = index // self.num_choices
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        text, rows = "", _LogprobRows()
        if index not in self._offsets:  # this choice's first chunk carries the echo
            text, rows = self._echo(prompt_index) if self.echo else ("", _LogprobRows())
            self._offsets[index] = len(text)
        self._offsets[index] = self._add_tokens(rows, output.new_token_ids, output.new_logprobs,
                                                output.new_top_logprobs, self._offsets[index])
        text += output.new_text
        logprobs = rows.to_wire(self.num_top_logprobs > 0) if self.with_logprobs else None
        if not (text or output.finished or (logprobs and logprobs.tokens)):
            return []
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=openai_finish_reason(output.finish_reason))
        return [CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[choice])]

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)

    def _echo(self, prompt_index: int) -> tuple[str, _LogprobRows]:
        """The echoed prompt's text and, when asked, its tokens with their logprobs."""
        text = self.prompt_texts[prompt_index]
        rows = _LogprobRows()
        if not self.with_logprobs:
            return text, rows
        token_ids = self.prompts[prompt_index]
        entries = self._prompt_logprobs.get(prompt_index) or (None,) * len(token_ids)
        offset = 0
        for token, entry in zip(token_strings(self.tokenizer, token_ids), entries):
            logprob = entry[0][1] if entry else None
            rows.add(token, logprob, self._top_dict(entry) if entry else None, offset)
            offset += len(token)
        return text, rows

    def _add_tokens(self, rows: _LogprobRows, token_ids: Sequence[int], logprobs: Sequence[float],
                    tops: Sequence[TopLogprobs], offset: int) -> int:
        """Append the tokens' logprob rows; returns the text offset after them."""
        if not self.with_logprobs:
            return offset
        for position, (token_id, token) in enumerate(zip(token_ids, token_strings(self.tokenizer, token_ids))):
            logprob = logprobs[position] if position < len(logprobs) else None
            top = tops[position] if position < len(tops) else ()
            rows.add(token, logprob, self._top_dict(((token_id, logprob), *top)), offset)
            offset += len(token)
        return offset

    def _top_dict(self, entry: TopLogprobs) -> dict[str, float]:
        """The sampled (or prompt) token first, then its alternatives (vLLM's shape)."""
        top: dict[str, float] = {}
        for token_id, logprob in entry[: self.num_top_logprobs + 1]:
            if logprob is not None:
                top.setdefault(self.tokenizer.decode([token_id]), logprob)
        return top
