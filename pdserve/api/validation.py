"""One validation of an OpenAI request body, applied before any work by the proxy and the workers alike.

Invariant: a body the proxy accepts is one every worker accepts and the
other way round, because both run this code with the same `LimitsConfig`:
size, JSON well-formedness and depth, the schema (pdserve/api/protocol.py), then
the bounds on prompts, messages, choices, stop conditions, logit bias and
output constraints — all before anything is tokenized, computed or pinned. Torch-free; the proxy imports it.
"""

from __future__ import annotations

import json
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import InvalidRequest, RequestTooLarge
from pdserve.api.json_text import parse_json_text
from pdserve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAIRequest
from pdserve.api.tokenize_protocol import TokenizeRequest

REQUEST_ID_HEADER = "X-Request-Id"
# What clients may send; internal records (kv_transfer_params, KV messages) allow 256: room for `#<n>`.
MAX_REQUEST_ID_CHARS = 240
_MAX_REPORTED_ERRORS = 3
# What shapes the output's grammar (tools too: a tool_choice turns their schemas into one).
_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "tools")

BodyT = TypeVar("BodyT", bound=BaseModel)


def check_request_id(wanted: str) -> None:
    if len(wanted) > MAX_REQUEST_ID_CHARS or not all(" " < char <= "~" for char in wanted):
        raise InvalidRequest(
            f"{REQUEST_ID_HEADER} must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces",
            param=REQUEST_ID_HEADER,
        )


def schema_for_path(path: str) -> type[OpenAIRequest]:
    return ChatCompletionRequest if path.endswith("/chat/completions") else CompletionRequest


def parse_json_body(raw: bytes, limits: LimitsConfig) -> Any:
    """The body as Python values; 413 when too large, 400 when not strict JSON or nested too deep."""
    if len(raw) > limits.max_body_bytes:
        raise RequestTooLarge(f"the request body has {len(raw)} bytes; at most {limits.max_body_bytes} are accepted")
    return parse_json_text(raw, limits.max_json_depth, "the request body")


def validate_request(schema: type[BodyT], body: Any, limits: LimitsConfig) -> BodyT:
    """Schema, then bounds: the typed request, or a 400 naming the first offending field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = schema.model_validate(body)
    except ValidationError as error:
        raise invalid_request_from_validation(error) from None
    check_request_bounds(request, limits)
    return request


def parse_request(schema: type[BodyT], raw: bytes, limits: LimitsConfig) -> BodyT:
    return validate_request(schema, parse_json_body(raw, limits), limits)


def check_request_bounds(request: BaseModel, limits: LimitsConfig) -> None:
    """Everything a request may ask for in size, checked before any tokenizing."""
    if isinstance(request, TokenizeRequest):
        _check_messages(request.messages or [], limits)
        _check_prompts(request.prompt or "", limits)
    if not isinstance(request, OpenAIRequest):
        return
    num_prompts = 1
    if isinstance(request, ChatCompletionRequest):
        _check_messages(request.messages, limits)
    elif isinstance(request, CompletionRequest):
        num_prompts = _check_prompts(request.prompt, limits)
    _check_at_most(num_prompts * request.num_choices, limits.max_choices, "answers (n times the prompts)", "n")
    stop = request.stop
    strings = [stop] if isinstance(stop, str) else list(stop or ())
    _check_at_most(len(strings), limits.max_stop_strings, "stop strings", "stop")
    _check_at_most(max(map(len, strings), default=0), limits.max_stop_string_chars, "characters in a stop string",
                   "stop")
    _check_at_most(len(request.stop_token_ids or ()), limits.max_stop_token_ids, "stop_token_ids",
                   "stop_token_ids")
    _check_at_most(len(request.logit_bias or ()), limits.max_logit_bias_entries, "logit_bias entries", "logit_bias")
    if request.requested_max_tokens is not None:  # without it, the workers check (they know the context)
        check_output_budget(num_prompts * request.num_choices * answer_entries(
            request.requested_max_tokens, request.top_logprobs_count), limits)
    _check_constraint(request, limits)


def answer_entries(max_tokens: int, top_logprobs: int, num_prompt_tokens: int = 0,
                   prompt_logprobs: Optional[int] = None) -> int:
    """Token entries one answer may carry: each generated token with its alternatives, and with prompt
    logprobs each prompt token with its alternatives."""
    prompt = num_prompt_tokens * (1 + prompt_logprobs) if prompt_logprobs is not None else 0
    return max_tokens * (1 + top_logprobs) + prompt


def check_output_budget(num_entries: int, limits: LimitsConfig) -> None:
    """A 400 when a request's answer could hold more token entries than `max_output_entries`."""
    _check_at_most(num_entries, limits.max_output_entries,
                   "token entries the answer could hold (answers x max_tokens x (1 + top_logprobs), "
                   "plus echoed prompt logprobs)", "max_tokens")


def _check_messages(messages: list[ChatMessage], limits: LimitsConfig) -> None:
    _check_at_most(len(messages), limits.max_messages, "messages", "messages")
    num_chars = sum(len(message.text()) for message in messages)
    _check_at_most(num_chars, limits.max_prompt_chars, "characters of message text", "messages")


def _check_prompts(prompt: Any, limits: LimitsConfig) -> int:
    """The number of prompts of a completion request, after bounding it and their text together."""
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if batched else [prompt]
    _check_at_most(len(prompts), limits.max_prompts, "prompts", "prompt")
    num_chars = sum(len(item) for item in prompts if isinstance(item, str))
    _check_at_most(num_chars, limits.max_prompt_chars, "prompt characters", "prompt")
    return len(prompts)


def _check_constraint(request: OpenAIRequest, limits: LimitsConfig) -> None:
    """Bounded before anything parses or compiles it; then its shape is checked here, so a prefill
    leg never computes a prompt whose decode leg would refuse the constraint."""
    tools = getattr(request, "tools", None) or ()
    _check_at_most(len(tools), limits.max_tools, "tools", "tools")
    sizes = {name: _json_chars(getattr(request, name, None)) for name in _CONSTRAINT_FIELDS}
    largest = max(sizes, key=lambda name: sizes[name])
    _check_at_most(sum(sizes.values()), limits.max_constraint_chars, "characters of output constraints", largest)
    request.output_constraint()


def _json_chars(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, BaseModel):
        return len(value.model_dump_json(by_alias=True, exclude_none=True))
    if isinstance(value, list):
        return sum(_json_chars(item) for item in value)
    return len(json.dumps(value))


def _check_at_most(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise InvalidRequest(f"{param}: {count} {what}; at most {limit} are accepted", param=param)


# ---------------------------------------------------------------- pydantic's errors, summarised


def invalid_request_from_validation(exc: Any) -> InvalidRequest:
    """Summarise pydantic's (or FastAPI's) errors into one readable message and the first offending field."""
    errors = exc.errors()
    params = [_location(error) for error in errors]
    described = [_describe(error, param) for error, param in zip(errors, params)]
    message = "; ".join(described[:_MAX_REPORTED_ERRORS])
    if len(described) > _MAX_REPORTED_ERRORS:
        message += f" (and {len(described) - _MAX_REPORTED_ERRORS} more)"
    return InvalidRequest(message, param=params[0] if params and params[0] else None)


def _location(error: Any) -> str:
    # FastAPI prefixes locations with where the value came from ("body", "query").
    parts = [str(part) for part in error.get("loc", ())]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts)


def _describe(error: Any, param: str) -> str:
    kind = error.get("type")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
    if kind in ("model_type", "model_attributes_type", "dict_type") and not param:
        return "the request body must be a JSON object"
    text = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param}: {text}" if param else text
