"""Turns generated text into OpenAI tool calls. Torch-free.

Invariant: text that does not parse as the expected format is returned as
plain content, never dropped and never turned into a half-formed call.
Native formats ("auto"), chosen by what the checkpoint's chat template writes:
  hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5, Qwen3, Hermes, SmolLM3
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]        Mistral
Forced calls: "required" is a JSON array of {"name", "arguments"} objects; a
named function's answer is its arguments object alone (see pdserve/grammar/compiler.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def with_id(self) -> "ParsedToolCall":
        return self if self.id else ParsedToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")


def _call_from(item: Any, arguments_key: str = "arguments") -> Optional[ParsedToolCall]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(item["name"], text).with_id()


def parse_required(text: str) -> list[ParsedToolCall]:
    """The answer to tool_choice="required": a JSON array of calls (the grammar guarantees it unless cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [_call_from(item) for item in items] if isinstance(items, list) else []
    return [call for call in calls if call is not None]


def parse_named(name: str, text: str) -> list[ParsedToolCall]:
    return [ParsedToolCall(name, text).with_id()]


class HermesToolParser:
    name = "hermes"
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[start:]):
            try:
                call = _call_from(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []  # malformed: the user sees what the model wrote
            calls.append(call)
        return text[:start].rstrip(), calls


class MistralToolParser:
    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        start = text.find(self.start_marker)
        if start < 0:
            return text, []
        calls = parse_required(text[start + len(self.start_marker):].strip())
        if not calls:
            return text, []
        return text[:start].rstrip(), calls


ToolParser = HermesToolParser | MistralToolParser


def parser_for_template(chat_template: Optional[str]) -> Optional[ToolParser]:
    """The native tool-call format a chat template writes, if it has one we read."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesToolParser()
    if "[TOOL_CALLS]" in chat_template:
        return MistralToolParser()
    return None


def held_back_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could still grow into `marker` (held back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
