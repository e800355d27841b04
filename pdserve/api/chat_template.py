"""Rendering a checkpoint's Jinja chat template into a prompt string.

Templates come from downloaded checkpoints, so they run in jinja2's immutable
sandbox; the environment mirrors the one templates are written against
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a JSON `tojson`,
`strftime_now`) so a template renders byte-for-byte as its authors expect.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.api.errors import InvalidRequest


class TemplateError(InvalidRequest):
    """The chat template rejected the conversation (its `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes <, > and &, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class ChatTemplate:
    """One compiled template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`; extra kwargs (tools, enable_thinking...) reach the template."""
        # tools/documents are always defined (None when absent), as templates are written to expect.
        context = {"tools": None, "documents": None, **self._special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"chat template failed to render these messages: {exc}") from exc
