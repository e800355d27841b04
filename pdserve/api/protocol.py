"""OpenAI wire schemas of `/v1/completions` and `/v1/chat/completions`, and their mapping to `SamplingParams`.

Torch-free. Known fields are validated strictly (types and ranges) and features
we do not implement (`suffix`, `best_of` > 1) are rejected with a 400 rather
than silently ignored; unknown fields are ignored because OpenAI clients send
extras. docs/api.md lists every field and the behaviour it follows.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pdserve.api.errors import ContextLengthExceeded, InvalidRequest
from pdserve.api.json_text import EMBEDDED_JSON_MAX_DEPTH, parse_json_text
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.api.structured_protocol import (
    NamedToolChoice,
    OutputConstraint,
    ResponseFormat,
    Tool,
    ToolChoice,
    combine_constraints,
    guided_constraint,
    response_format_constraint,
    tool_constraint,
)

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: ASCII digits, int32-sized
_MAX_TOKEN_ID = 2**31 - 1
MAX_CHOICES = 128  # OpenAI's bound on n; n times the prompts is bounded by `LimitsConfig.max_choices`

# Validators raise `InvalidRequest` (not ValueError) for semantic rejections:
# pydantic lets non-ValueError exceptions propagate unchanged, so they reach the
# server's error mapping with their precise `param`.


class _WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)


def _reject_unless(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequest(message, param=param)


class StreamOptions(_WireModel):
    include_usage: Optional[bool] = None


class OpenAIRequest(_WireModel):
    """Fields shared by completions and chat completions."""

    _logit_bias_pairs: tuple[tuple[int, float], ...] = PrivateAttr(default=())

    model: Optional[str] = None  # absent: the served model
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)  # extension; -1 and 0 disable
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # extension
    ignore_eos: Optional[bool] = None  # extension
    min_tokens: Optional[int] = Field(None, ge=0)  # extension
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)  # extension (HF semantics)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None  # extensions (vLLM)
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # P/D hand-off, opaque here

    @field_validator("stop", mode="wrap")
    @classmethod
    def _check_stop(cls, value: Any, handler: Any) -> Any:
        try:
            stop = handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of strings") from None
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: Optional[list[int]]) -> Optional[list[int]]:
        if value and min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if not value:
            return value
        for key, bias in value.items():
            # ASCII digits only and int32-sized: str.isdigit() also takes "²" and 5,000-digit keys,
            # on which int() raises. The pairs are parsed here, once (`logit_bias_pairs`).
            shown = key if len(key) <= 24 else key[:24] + "..."
            _reject_unless(_TOKEN_ID_KEY.fullmatch(key) is not None and int(key) <= _MAX_TOKEN_ID,
                           f"logit_bias keys must be token ids, got {shown!r}", "logit_bias")
            _reject_unless(-100.0 <= bias <= 100.0, f"logit_bias values must be in [-100, 100], got {bias}",
                           "logit_bias")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> "OpenAIRequest":
        self._logit_bias_pairs = tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())
        _reject_unless(
            self.stream_options is None or bool(self.stream),
            "stream_options is only allowed when stream is true", "stream_options",
        )
        max_tokens = self.requested_max_tokens
        _reject_unless(
            max_tokens is None or (self.min_tokens or 0) <= max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens",
        )
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, parsed when the request was validated."""
        return self._logit_bias_pairs

    def output_constraint(self) -> Optional[OutputConstraint]:
        """The grammar the answer must follow, from whichever one field asks for it (a second is a 400)."""
        return combine_constraints(
            ("response_format", response_format_constraint(self.response_format)),
            ("guided_json", guided_constraint(self.guided_json, self.guided_regex, self.guided_choice)),
        )

    @property
    def top_logprobs_count(self) -> int:
        return 0  # alternatives per sampled token; each endpoint spells it its own way

    @property
    def prompt_logprobs_count(self) -> Optional[int]:
        return None  # completions' echo asks for the prompt's logprobs

    @property
    def requested_max_tokens(self) -> Optional[int]:
        """`max_completion_tokens` wins over the older `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def wants_logprobs(self) -> bool:
        return False  # each endpoint spells logprobs its own way and overrides this


class CompletionRequest(OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: Any) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists") from None
        return prompt  # how many prompts and how long: `LimitsConfig` (pdserve/api/validation.py)

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: Optional[str]) -> Optional[str]:
        _reject_unless(not value, "suffix is not supported", "suffix")
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: Optional[int]) -> Optional[int]:
        _reject_unless(value in (None, 1), "only best_of=1 is supported", "best_of")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_logprobs_count(self) -> int:
        return self.logprobs or 0

    @property
    def prompt_logprobs_count(self) -> Optional[int]:
        return self.logprobs if self.echo and self.logprobs is not None else None

    def prompt_inputs(self) -> list[Union[str, list[int]]]:
        """Every prompt of the request, in order, as text or token ids; none empty."""
        prompt = self.prompt
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if batched else [prompt]
        for item in prompts:
            _reject_unless(len(item) > 0, "prompt must not be empty", "prompt")
        return prompts


class TextContentPart(_WireModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(_WireModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_WireModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool's answer to one of them

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of {'type': 'text', 'text': ...} parts") from None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        # Chat templates know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            # Templates format arguments themselves (`| tojson`): hand them objects where the JSON parses.
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> Any:
    try:
        return parse_json_text(text, EMBEDDED_JSON_MAX_DEPTH, "tool call arguments")
    except InvalidRequest:
        return text


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True  # extension

    @model_validator(mode="after")
    def _check_chat_consistency(self) -> "ChatCompletionRequest":
        _reject_unless(not self.top_logprobs or bool(self.logprobs),
                       "top_logprobs needs logprobs=true", "top_logprobs")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def top_logprobs_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def tool_choice_mode(self) -> str:
        """none | auto | required | named: what the answer may hold (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    def output_constraint(self) -> Optional[OutputConstraint]:
        return combine_constraints(
            ("tool_choice", tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)),
            ("response_format", response_format_constraint(self.response_format)),
            ("guided_json", guided_constraint(self.guided_json, self.guided_regex, self.guided_choice)),
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template_dict() for message in self.messages]

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """Tools as chat templates expect them (OpenAI's shape); None when the template must not show any."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools]


def to_sampling_params(
    request: OpenAIRequest, *, num_prompt_tokens: int, max_model_len: int, prompt_param: str = "prompt",
    grammar: Optional[str] = None,
) -> SamplingParams:
    """Map a validated request to engine sampling parameters.

    Raises `ContextLengthExceeded` when the prompt, or the prompt plus the
    requested tokens, does not fit `max_model_len`. Absent max tokens means
    "the rest of the context".
    """
    max_tokens = check_token_budget(num_prompt_tokens, request.requested_max_tokens, request.min_tokens,
                                    max_model_len, prompt_param=prompt_param)
    min_tokens = request.min_tokens or 0
    stop = request.stop
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        seed=request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=bool(request.ignore_eos),
        min_tokens=min_tokens,
        logprobs=request.wants_logprobs,
        top_logprobs=request.top_logprobs_count,
        prompt_logprobs=request.prompt_logprobs_count,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=request.logit_bias_pairs(),
        grammar=grammar,
    )


def check_token_budget(num_prompt_tokens: int, max_tokens: Optional[int], min_tokens: Optional[int],
                       max_model_len: int, *, prompt_param: str = "prompt") -> int:
    """The tokens a request may generate (absent max_tokens: the rest of the context), or a 400 when
    the prompt and what it asks for do not fit. A prefill worker runs this on the decode leg's
    budget too, so it never computes a prompt the decode worker would refuse."""
    check_context_length(num_prompt_tokens, max_tokens, max_model_len, prompt_param=prompt_param)
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    min_tokens = min_tokens or 0
    _reject_unless(
        min_tokens <= max_tokens, f"min_tokens ({min_tokens}) exceeds the {max_tokens} tokens left", "min_tokens"
    )
    return max_tokens


def check_context_length(
    num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int, *, prompt_param: str = "prompt"
) -> None:
    if num_prompt_tokens >= max_model_len:
        why = ", which leaves no room for a generated token" if num_prompt_tokens == max_model_len else ""
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens{why}.",
            param=prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} prompt "
            f"tokens + {max_tokens} max_tokens = {num_prompt_tokens + max_tokens} tokens were requested; "
            f"reduce max_tokens to at most {max_model_len - num_prompt_tokens}.",
            param="max_tokens",
        )


FinishReasonWire = Literal["stop", "length", "tool_calls"]


def openai_finish_reason(reason: Optional[FinishReason]) -> Optional[Literal["stop", "length"]]:
    if reason is FinishReason.STOP:
        return "stop"
    if reason is FinishReason.LENGTH:
        return "length"
    return None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(_WireModel):
    cached_tokens: int = 0


class UsageInfo(_WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


def _none(value: Any) -> bool:
    return value is None


class CompletionLogprobs(_WireModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]  # None for an echoed prompt's first token
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


class CompletionChoice(_WireModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReasonWire] = None


class CompletionResponse(_WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = Field(None, exclude_if=_none)


class TopLogprob(_WireModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_WireModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_WireModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(_WireModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[list[ToolCall]] = Field(None, exclude_if=_none)


class ChatChoice(_WireModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[FinishReasonWire] = None


class ChatCompletionResponse(_WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = Field(None, exclude_if=_none)


class ToolCallFunctionDelta(_WireModel):
    name: Optional[str] = Field(None, exclude_if=_none)
    arguments: str = ""


class ToolCallDelta(_WireModel):
    index: int
    id: Optional[str] = Field(None, exclude_if=_none)
    type: Optional[Literal["function"]] = Field(None, exclude_if=_none)
    function: ToolCallFunctionDelta


class ChatDelta(_WireModel):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=_none)
    content: Optional[str] = Field(None, exclude_if=_none)
    tool_calls: Optional[list[ToolCallDelta]] = Field(None, exclude_if=_none)


class ChatStreamChoice(_WireModel):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[FinishReasonWire] = None


class ChatCompletionChunk(_WireModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(_WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(_WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_WireModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None  # the HTTP status, also inside SSE error events


class ErrorResponse(_WireModel):
    error: ErrorInfo
