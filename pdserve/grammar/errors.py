"""The grammar layer's own errors, importable without llguidance (the HTTP edge maps them to 400s)."""

from __future__ import annotations


class GrammarTokenizerUnavailable(ValueError):
    """The model's tokenizer cannot be turned into llguidance's view of the vocabulary (remembered: never retried)."""
