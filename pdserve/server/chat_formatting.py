"""The chat completions format: messages, chat logprobs, and tool calls (whole or streamed as deltas).

Tool modes (see pdserve/tools/parsers.py): "named" streams the arguments as
they are generated; "required" and "auto" hold text that may be a call until
the choice ends, then send each call whole in one delta, while "auto" streams
ordinary content up to the start of the template's tool-call marker.
finish_reason is "tool_calls" when a required or auto answer holds calls
(OpenAI answers "stop" for a named function, and so do we).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pydantic import BaseModel

from pdserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    UsageInfo,
    openai_finish_reason,
)
from pdserve.api.sampling import FinishReason, TopLogprobs
from pdserve.request import RequestOutput
from pdserve.server.formatting import token_strings, wire_params
from pdserve.server.generation import GenerationResult
from pdserve.tools.parsers import ParsedToolCall, ToolParser, held_back_length, parse_named, parse_required


@dataclass(frozen=True, slots=True)
class ToolMode:
    kind: str = "none"  # none | auto | required | named
    function_name: str = ""  # named
    parser: Optional[ToolParser] = None  # auto: the template's native format (None: plain text)


@dataclass(slots=True)
class _ChoiceState:
    text: str = ""  # everything generated so far
    num_sent_chars: int = 0  # of `text`, sent as content or arguments
    call_id: str = ""  # named: the one call's id, sent with the first delta


def _finish_reason(reason: Optional[FinishReason], calls: Sequence[ParsedToolCall], mode: ToolMode) -> Optional[str]:
    wire = openai_finish_reason(reason)
    if calls and mode.kind in ("auto", "required") and wire == "stop":
        return "tool_calls"
    return wire


@dataclass(slots=True)
class ChatFormat:
    response_id: str
    model: str
    created: int
    tokenizer: Any
    with_logprobs: bool
    num_top_logprobs: int = 0
    num_choices: int = 1
    tools: ToolMode = field(default_factory=ToolMode)
    _states: dict[int, _ChoiceState] = field(default_factory=dict)

    def split(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        """A finished answer's content and tool calls."""
        mode = self.tools
        if mode.kind == "named":
            return None, parse_named(mode.function_name, text)
        if mode.kind == "required":
            calls = parse_required(text)
            return (None if calls else text), calls
        if mode.kind == "auto" and mode.parser is not None:
            content, calls = mode.parser.parse(text)
            return (content or None) if calls else text, calls
        return text, []

    def final_response(self, results: Sequence[GenerationResult], usage: UsageInfo) -> BaseModel:
        choices = []
        for index, result in enumerate(results):
            content, calls = self.split(result.text)
            message = AssistantMessage(content=content, tool_calls=[_tool_call(call) for call in calls] or None)
            choices.append(ChatChoice(
                index=index, message=message,
                logprobs=self._logprobs(result.token_ids, result.logprobs, result.top_logprobs),
                finish_reason=_finish_reason(result.finish_reason, calls, self.tools),
            ))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage, kv_transfer_params=wire_params(results[0].kv_transfer_params))

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))
                for index in range(self.num_choices)]

    def output_chunks(self, index: int, output: RequestOutput) -> list[BaseModel]:
        state = self._states.setdefault(index, _ChoiceState())
        state.text += output.new_text
        logprobs = self._logprobs(output.new_token_ids, output.new_logprobs, output.new_top_logprobs)
        delta, calls = self._delta(state, output.finished)
        has_logprobs = bool(logprobs and logprobs.content)
        if not (delta.content or delta.tool_calls or output.finished or has_logprobs):
            return []
        finish = _finish_reason(output.finish_reason, calls, self.tools) if output.finished else None
        return [self._chunk(ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish))]

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)

    def _delta(self, state: _ChoiceState, finished: bool) -> tuple[ChatDelta, list[ParsedToolCall]]:
        mode = self.tools
        if mode.kind == "named":
            return self._argument_delta(state), [] if not finished else parse_named(mode.function_name, state.text)
        if mode.kind == "none" or (mode.kind == "auto" and mode.parser is None):
            return ChatDelta(content=self._take(state, len(state.text))), []
        if not finished:
            return ChatDelta(content=self._streamable_content(state)), []
        content, calls = self.split(state.text)
        if not calls:
            return ChatDelta(content=self._take(state, len(state.text))), []
        rest = (content or "")[state.num_sent_chars:] or None
        state.num_sent_chars = len(state.text)
        deltas = [ToolCallDelta(index=i, id=call.id, type="function",
                                function=ToolCallFunctionDelta(name=call.name, arguments=call.arguments))
                  for i, call in enumerate(calls)]
        return ChatDelta(content=rest, tool_calls=deltas), calls

    def _streamable_content(self, state: _ChoiceState) -> Optional[str]:
        """auto: content up to the tool-call marker, holding back what may still become it; required: nothing."""
        if self.tools.kind != "auto" or self.tools.parser is None:
            return None
        marker = self.tools.parser.start_marker
        marker_at = state.text.find(marker)
        end = marker_at if marker_at >= 0 else len(state.text) - held_back_length(state.text, marker)
        return self._take(state, end)

    def _argument_delta(self, state: _ChoiceState) -> ChatDelta:
        arguments = self._take(state, len(state.text)) or ""
        if not arguments and state.call_id:
            return ChatDelta()
        first = not state.call_id
        if first:
            state.call_id = parse_named(self.tools.function_name, "")[0].id
        call = ToolCallDelta(index=0, id=state.call_id if first else None, type="function" if first else None,
                             function=ToolCallFunctionDelta(name=self.tools.function_name if first else None,
                                                            arguments=arguments))
        return ChatDelta(tool_calls=[call])

    @staticmethod
    def _take(state: _ChoiceState, end: int) -> Optional[str]:
        if end <= state.num_sent_chars:
            return None
        piece = state.text[state.num_sent_chars:end]
        state.num_sent_chars = end
        return piece

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs]) -> Optional[ChatChoiceLogprobs]:
        if not self.with_logprobs:
            return None
        content = []
        for position, (token, logprob) in enumerate(zip(token_strings(self.tokenizer, token_ids), logprobs)):
            top = tops[position] if position < len(tops) else ()
            content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")),
                                            top_logprobs=[self._top(entry) for entry in top]))
        return ChatChoiceLogprobs(content=content)

    def _top(self, entry: tuple[int, float]) -> TopLogprob:
        token = self.tokenizer.decode([entry[0]])
        return TopLogprob(token=token, logprob=entry[1], bytes=list(token.encode("utf-8")))


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=ToolCallFunction(name=call.name, arguments=call.arguments))
