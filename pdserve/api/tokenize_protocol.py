"""Wire schemas of `POST /tokenize` and `POST /detokenize` (vLLM's shapes). Torch-free."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.protocol import ChatMessage


class _WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)


class TokenizeRequest(_WireModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True  # prompt only: a rendered template carries its own
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template_dict() for message in self.messages or []]


class TokenizeResponse(_WireModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = Field(None, exclude_if=lambda value: value is None)


class DetokenizeRequest(_WireModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_WireModel):
    prompt: str
