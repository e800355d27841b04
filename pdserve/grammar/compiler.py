"""Turns an `OutputConstraint` into llguidance grammar text, validated at the HTTP edge.

Invariant: a grammar that reaches the engine compiled here without error, so a
bad schema or regex is a 400 naming the parameter, never an engine fault.
Compiling is CPU work of up to milliseconds: callers run it off the event loop.
"""

from __future__ import annotations

import re
from typing import Any

import llguidance

from pdserve.api.errors import InvalidRequest
from pdserve.api.structured_protocol import OutputConstraint, tool_calls_schema

# Compact JSON with the separators models are trained on; no free whitespace, so a
# small model cannot wander off into endless newlines inside a structure.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def _schema_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def grammar_text(constraint: OutputConstraint) -> str:
    """The llguidance grammar of `constraint` (not yet validated)."""
    kind = constraint.kind
    if kind == "json_object":
        return _schema_grammar(ANY_JSON_OBJECT)
    if kind in ("json_schema", "tool_call"):
        return _schema_grammar(constraint.schema or ANY_JSON_OBJECT)
    if kind == "tool_calls":
        return _schema_grammar(tool_calls_schema(constraint.tools, constraint.allow_many))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.pattern or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(choice) for choice in constraint.choices))
    raise ValueError(f"unknown constraint kind {kind!r}")


def compile_constraint(constraint: OutputConstraint) -> str:
    """Grammar text for the engine; InvalidRequest naming the constraint's field when it cannot be compiled."""
    param = constraint.param or "response_format"
    try:
        grammar = grammar_text(constraint)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        first_line = error.strip().splitlines()[0] if error.strip() else error
        raise InvalidRequest(f"{param}: the grammar cannot be compiled: {first_line}", param=param)
    return grammar
