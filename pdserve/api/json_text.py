"""JSON text in a request turned into values once, strictly, within a depth bound.

The body itself, a `guided_json` schema sent as a string and tool-call arguments all
go through here. Invariant: bad or hostile text (not JSON, NaN, lone surrogates,
nesting deep enough to exhaust a recursive parser) comes out as `InvalidRequest`
(400), never as a `RecursionError` or a `ValueError` from a later step.
"""

from __future__ import annotations

from typing import Any, Union

import pydantic_core

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import InvalidRequest

_CONTAINER_TYPES = frozenset({dict, list})
# JSON carried inside a string field (a guided_json schema, tool-call arguments) is held to the
# depth the body itself gets by default.
EMBEDDED_JSON_MAX_DEPTH: int = LimitsConfig.model_fields["max_json_depth"].default


def too_deep(max_depth: int, what: str = "the request body") -> InvalidRequest:
    return InvalidRequest(f"{what} is nested deeper than {max_depth} levels")


def check_json_depth(value: Any, max_depth: int, what: str = "the request body") -> None:
    """Iterative (a deep document must not exhaust the stack); the top-level value is depth 1."""
    stack = [(value, 1)] if type(value) in _CONTAINER_TYPES else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if _CONTAINER_TYPES.isdisjoint(map(type, children)):
            continue
        if depth >= max_depth:
            raise too_deep(max_depth, what)
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINER_TYPES)


def parse_json_text(text: Union[str, bytes], max_depth: int, what: str) -> Any:
    """The values `text` holds; `InvalidRequest` naming `what` when it is not strict JSON or nests too deep."""
    try:
        # NaN and Infinity are not JSON; lone surrogates in strings are refused too.
        value = pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError as error:
        if "recursion limit" in str(error):
            raise too_deep(max_depth, what) from None
        raise InvalidRequest(f"{what} is not valid JSON: {error}") from None
    check_json_depth(value, max_depth, what)
    return value
