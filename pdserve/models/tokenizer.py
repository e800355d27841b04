"""Text <-> token ids for one model, its chat template, and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` built from an HF `tokenizer.json`
or from a GGUF vocabulary; its ids are the model's ids. `IncrementalDetokenizer`
turns a growing id list into text deltas that never split a UTF-8 character
and that concatenate to exactly `decode(all ids)`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tokenizers import Tokenizer as Backend

from pdserve.api.chat_template import ChatTemplate, TemplateError
from pdserve.models.gguf_tokenizer import build_gguf_backend
from pdserve.models.hf_config import ModelLoadError, eos_ids_of

if TYPE_CHECKING:  # the GGUF reader loads torch; the engine loop detokenizes without it
    from pdserve.models.gguf_file import GGUFVocab

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
    ):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos_from_token = [backend.token_to_id(eos_token)] if eos_token else []
        merged = [i for i in [*eos_token_ids, *eos_from_token] if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(merged))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        specials = {"bos_token": bos_token, "eos_token": eos_token}
        self._template = ChatTemplate(chat_template, specials) if chat_template else None

    @property
    def backend(self) -> Backend:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Use add_special_tokens=False for a rendered chat
        template, which already spells out its BOS."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the checkpoint's template; TemplateError (HTTP 400) when it refuses."""
        if self._template is None:
            raise TemplateError("this model has no chat template; use the completions endpoint")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    @classmethod
    def from_gguf_vocab(cls, vocab: GGUFVocab) -> "Tokenizer":
        def token(token_id: int | None) -> str | None:
            return vocab.tokens[token_id] if token_id is not None and 0 <= token_id < len(vocab.tokens) else None

        return cls(
            build_gguf_backend(vocab),
            bos_token=token(vocab.bos_token_id),
            eos_token=token(vocab.eos_token_id),
            eos_token_ids=[vocab.eos_token_id] if vocab.eos_token_id is not None else [],
            chat_template=vocab.chat_template,
        )

    @classmethod
    def from_hf_dir(cls, directory: str) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (special tokens, template), the
        template file if any, and generation_config.json / config.json eos ids."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ModelLoadError(f"{directory} has no tokenizer.json")
        tokenizer_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        eos_ids = [
            *eos_ids_of(_read_json(os.path.join(directory, "generation_config.json"))),
            *eos_ids_of(_read_json(os.path.join(directory, "config.json"))),
        ]
        return cls(
            Backend.from_file(path),
            bos_token=_token_text(tokenizer_config.get("bos_token")),
            eos_token=_token_text(tokenizer_config.get("eos_token")),
            eos_token_ids=eos_ids,
            chat_template=_chat_template(directory, tokenizer_config),
        )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """Special tokens are saved either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: str, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config's entry (string, or a list of named templates)."""
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence.

    Each push decodes only a short window (the tokens of the previous delta as
    context, plus the new ones) and returns the text past the context. Text
    whose tail is an incomplete UTF-8 sequence (decoded as U+FFFD) is held back
    until the next tokens complete it; `flush()` releases whatever is left, so
    all pushes plus flush concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # first token whose text has not been emitted
        self._emitted: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text ("" if none yet)."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        window = decode(self._ids[self._prefix_offset :], self._skip_special)
        if window.endswith(REPLACEMENT_CHAR):
            return ""
        if window.startswith(context):
            delta = window[len(context) :]
        else:
            # The window decoded differently from its context alone: fall back to the full text.
            delta = self._unemitted_tail()
        if not delta:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Release held-back text (e.g. a sequence that ends mid-character) at end of stream."""
        rest = self._unemitted_tail()
        if rest:
            self._emitted.append(rest)
        self._prefix_offset = self._read_offset = len(self._ids)
        return rest

    def _unemitted_tail(self) -> str:
        full = self._tokenizer.decode(self._ids, self._skip_special)
        emitted = self.text
        if not full.startswith(emitted):
            logger.warning("incremental text diverged from the full decode; emitting nothing more")
            return ""
        return full[len(emitted) :]
