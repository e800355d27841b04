"""OpenAI wire schemas of output constraints: `response_format`, `tools`/`tool_choice`, vLLM's `guided_*`.

Torch-free and grammar-library-free: this module only validates the shapes
and turns them into a `OutputConstraint` (what the answer must match). The
grammar text the engine runs is built from that by `pdserve/grammar/compiler.py`.
Invariant: every combination we cannot honour is a 400 naming the parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.errors import InvalidRequest
from pdserve.api.json_text import EMBEDDED_JSON_MAX_DEPTH, parse_json_text


class _WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)


class JsonSchemaFormat(_WireModel):
    name: str = "response"
    description: Optional[str] = None
    # `schema` would shadow BaseModel.schema: keep the wire name, rename the attribute.
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDefinition(_WireModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_WireModel):
    name: str


class NamedToolChoice(_WireModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What the generated text must be. kind: json_object | json_schema | regex | choice | tool_call | tool_calls."""

    kind: str
    schema: Optional[dict[str, Any]] = None  # json_schema, tool_call (the function's parameters)
    pattern: Optional[str] = None  # regex
    choices: tuple[str, ...] = ()  # choice
    tools: tuple[Tool, ...] = ()  # tool_calls: one of these, as [{"name", "arguments"}] items
    allow_many: bool = True  # tool_calls: more than one call allowed (parallel_tool_calls)
    param: str = ""  # the request field it came from, named in errors


def _parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def tool_calls_schema(tools: tuple[Tool, ...], allow_many: bool) -> dict[str, Any]:
    """JSON schema of `tool_choice="required"`: a non-empty array of calls of the listed functions."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": _parameters_schema(tool.function)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not allow_many:
        schema["maxItems"] = 1
    return schema


def _reject(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def response_format_constraint(response_format: Optional[ResponseFormat]) -> Optional[OutputConstraint]:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputConstraint("json_object")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise _reject("response_format of type json_schema needs json_schema.schema", "response_format")
    return OutputConstraint("json_schema", schema=spec.json_schema)


def guided_constraint(guided_json: Any, guided_regex: Optional[str],
                      guided_choice: Optional[list[str]]) -> Optional[OutputConstraint]:
    """vLLM's extensions; at most one of them."""
    given = [name for name, value in (("guided_json", guided_json), ("guided_regex", guided_regex),
                                      ("guided_choice", guided_choice)) if value is not None]
    if len(given) > 1:
        raise _reject(f"use only one of {', '.join(given)}", given[1])
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                schema = parse_json_text(guided_json, EMBEDDED_JSON_MAX_DEPTH, "guided_json")
            except InvalidRequest as error:
                raise _reject(error.message, "guided_json") from None
        else:
            schema = guided_json
        if not isinstance(schema, dict):
            raise _reject("guided_json must be a JSON schema object", "guided_json")
        return OutputConstraint("json_schema", schema=schema, param="guided_json")
    if guided_regex is not None:
        if not guided_regex:
            raise _reject("guided_regex must not be empty", "guided_regex")
        return OutputConstraint("regex", pattern=guided_regex, param="guided_regex")
    if guided_choice is not None:
        if not guided_choice or any(not choice for choice in guided_choice):
            raise _reject("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
        return OutputConstraint("choice", choices=tuple(guided_choice), param="guided_choice")
    return None


def tool_constraint(tools: Optional[list[Tool]], tool_choice: Optional[ToolChoice],
                    parallel_tool_calls: Optional[bool]) -> Optional[OutputConstraint]:
    """The grammar `tool_choice` imposes: none for "none"/"auto", a call for "required" or a named function."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise _reject("tool_choice needs tools", "tool_choice")
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return OutputConstraint("tool_calls", tools=tuple(tools), allow_many=parallel_tool_calls is not False)
    if not isinstance(tool_choice, NamedToolChoice):
        raise _reject(f"unknown tool_choice {tool_choice!r}", "tool_choice")
    named = [tool for tool in tools if tool.function.name == tool_choice.function.name]
    if not named:
        raise _reject(f"tool_choice names function {tool_choice.function.name!r}, which is not in tools",
                      "tool_choice")
    return OutputConstraint("tool_call", schema=_parameters_schema(named[0].function), tools=(named[0],))


def combine_constraints(*named: tuple[str, Optional[OutputConstraint]]) -> Optional[OutputConstraint]:
    """At most one source may constrain the output; a second one is a 400 naming it."""
    present = [(constraint.param or param, constraint) for param, constraint in named if constraint is not None]
    if len(present) > 1:
        raise _reject(f"{present[1][0]} cannot be combined with {present[0][0]}: both constrain the output",
                      present[1][0])
    if not present:
        return None
    param, constraint = present[0]
    return dataclasses.replace(constraint, param=constraint.param or param)
