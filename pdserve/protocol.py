"""OpenAI wire schemas of `/v1/completions` and `/v1/chat/completions`, and their mapping to `SamplingParams`.

Torch-free. Known fields are validated strictly (types and ranges) and features
we do not implement are rejected with a 400 rather than silently ignored;
unknown fields are ignored because OpenAI clients send extras.
Logprobs: only the sampled token's log-probability is supported (completions
`logprobs=0`, chat `logprobs=true` with `top_logprobs` 0 or absent); asking for
alternatives is a 400, since returning fewer than asked would mislead.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.errors import ContextLengthExceeded, InvalidRequest
from pdserve.request import FinishReason, SamplingParams

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
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
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

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: Optional[int]) -> Optional[int]:
        _reject_unless(value in (None, 1), f"only n=1 is supported, got n={value}", "n")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value: Optional[float], info: Any) -> Optional[float]:
        _reject_unless(value in (None, 0.0), f"{info.field_name} is not supported (only 0)", info.field_name)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        _reject_unless(not value, "logit_bias is not supported", "logit_bias")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> "OpenAIRequest":
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
            raise ValueError("must be a string, a list with one string, or a list of token ids") from None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            _reject_unless(len(prompt) == 1, "batched prompts are not supported: send one prompt", "prompt")
        return prompt

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value: Optional[bool]) -> Optional[bool]:
        _reject_unless(not value, "echo is not supported", "echo")
        return value

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: Optional[int]) -> Optional[int]:
        _reject_unless(
            value in (None, 0),
            "only logprobs=0 is supported: the sampled token's log-probability, without alternatives",
            "logprobs",
        )
        return value

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

    def prompt_input(self) -> Union[str, list[int]]:
        """The single prompt, as text or token ids; never empty."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        _reject_unless(len(prompt) > 0, "prompt must not be empty", "prompt")
        return prompt


class TextContentPart(_WireModel):
    type: Literal["text"]
    text: str


class ChatMessage(_WireModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None

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

    def template_dict(self) -> dict[str, str]:
        # Chat templates know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True  # extension

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: Optional[int]) -> Optional[int]:
        _reject_unless(
            value in (None, 0),
            "top_logprobs > 0 is not supported: only the sampled token's log-probability is returned",
            "top_logprobs",
        )
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        _reject_unless(not value, "tool calling is not supported", "tools")
        return value

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        _reject_unless(
            value is None or value.get("type") == "text", "only response_format type 'text' is supported",
            "response_format",
        )
        return value

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        return [message.template_dict() for message in self.messages]


def to_sampling_params(
    request: OpenAIRequest, *, num_prompt_tokens: int, max_model_len: int, prompt_param: str = "prompt"
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
    token_logprobs: list[float]
    top_logprobs: Optional[list[dict[str, float]]] = None
    text_offset: list[int]


class CompletionChoice(_WireModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class CompletionResponse(_WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = Field(None, exclude_if=_none)


class ChatTokenLogprob(_WireModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(_WireModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(_WireModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_WireModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class ChatCompletionResponse(_WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = Field(None, exclude_if=_none)


class ChatDelta(_WireModel):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=_none)
    content: Optional[str] = Field(None, exclude_if=_none)


class ChatStreamChoice(_WireModel):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


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
