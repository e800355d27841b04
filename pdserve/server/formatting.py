"""Build OpenAI response bodies and stream chunks from engine outputs, one class per endpoint.

The routes and the SSE writer only talk to the `ResponseFormat` protocol, so
completions and chat share one serving path and differ only here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from pydantic import BaseModel

from pdserve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    openai_finish_reason,
)
from pdserve.pd.params import RemotePrefillParams
from pdserve.request import RequestOutput
from pdserve.server.generation import GenerationResult, usage_info


class ResponseFormat(Protocol):
    def final_response(self, result: GenerationResult) -> BaseModel:
        """The whole answer of a non-streaming request."""
        ...

    def opening_chunks(self) -> list[BaseModel]:
        """Chunks sent before the first output (chat announces the assistant role)."""
        ...

    def output_chunks(self, output: RequestOutput) -> list[BaseModel]:
        """Chunks carrying one engine output; empty when it adds nothing visible."""
        ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        ...


def _token_strings(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in token_ids]


def _result_usage(result: GenerationResult) -> UsageInfo:
    return usage_info(result.num_prompt_tokens, len(result.token_ids), result.num_cached_tokens)


@dataclass(slots=True)
class CompletionFormat:
    response_id: str
    model: str
    created: int
    tokenizer: Any
    with_logprobs: bool
    text_offset: int = 0  # where the next streamed token's text starts, for `text_offset`

    def final_response(self, result: GenerationResult) -> BaseModel:
        choice = CompletionChoice(
            text=result.text,
            logprobs=self._logprobs(result.token_ids, result.logprobs),
            finish_reason=openai_finish_reason(result.finish_reason),
        )
        return CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, choices=[choice],
            usage=_result_usage(result), kv_transfer_params=_wire(result.kv_transfer_params),
        )

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def output_chunks(self, output: RequestOutput) -> list[BaseModel]:
        logprobs = self._logprobs(output.new_token_ids, output.new_logprobs)
        if not (output.new_text or output.finished or (logprobs and logprobs.tokens)):
            return []
        choice = CompletionChoice(
            text=output.new_text, logprobs=logprobs, finish_reason=openai_finish_reason(output.finish_reason)
        )
        return [CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[choice])]

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        tokens = _token_strings(self.tokenizer, token_ids)
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), text_offset=offsets)


@dataclass(slots=True)
class ChatFormat:
    response_id: str
    model: str
    created: int
    tokenizer: Any
    with_logprobs: bool

    def final_response(self, result: GenerationResult) -> BaseModel:
        choice = ChatChoice(
            message=AssistantMessage(content=result.text),
            logprobs=self._logprobs(result.token_ids, result.logprobs),
            finish_reason=openai_finish_reason(result.finish_reason),
        )
        return ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model, choices=[choice],
            usage=_result_usage(result), kv_transfer_params=_wire(result.kv_transfer_params),
        )

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(ChatStreamChoice(delta=ChatDelta(role="assistant", content="")))]

    def output_chunks(self, output: RequestOutput) -> list[BaseModel]:
        logprobs = self._logprobs(output.new_token_ids, output.new_logprobs)
        if not (output.new_text or output.finished or (logprobs and logprobs.content)):
            return []
        choice = ChatStreamChoice(
            delta=ChatDelta(content=output.new_text),
            logprobs=logprobs,
            finish_reason=openai_finish_reason(output.finish_reason),
        )
        return [self._chunk(choice)]

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> ChatChoiceLogprobs | None:
        if not self.with_logprobs:
            return None
        tokens = _token_strings(self.tokenizer, token_ids)
        return ChatChoiceLogprobs(
            content=[
                ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
                for token, logprob in zip(tokens, logprobs)
            ]
        )


def _wire(params: Optional[RemotePrefillParams]) -> Optional[dict]:
    return None if params is None else params.to_wire()
