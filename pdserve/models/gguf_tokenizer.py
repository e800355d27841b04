"""A `tokenizers` byte-level BPE rebuilt from a GGUF file's vocabulary.

Invariant: token ids are the GGUF's ids, unchanged; no token is ever appended
(so ids never exceed the model's vocabulary), and text splits as the model
was trained (the `tokenizer.ggml.pre` pattern).
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from pdserve.models.hf_config import UnsupportedModelFeature

if TYPE_CHECKING:  # the GGUF reader loads torch; the engine loop detokenizes without it
    from pdserve.models.gguf_file import GGUFVocab

logger = logging.getLogger(__name__)

CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

# Split patterns of the pre-tokenizers llama.cpp names; None = GPT-2's own (ByteLevel regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PATTERNS: Mapping[str, str | None] = MappingProxyType({
    "default": None,
    "gpt2": None,
    "smollm": None,  # GPT-2 split with single digits (see _pre_tokenizer)
    "starcoder": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
})
SINGLE_DIGIT_PRES = frozenset({"smollm", "starcoder"})


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (controls, space,
    a few Latin-1 gaps) are shifted to code points 256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _spelled(tokens: tuple[str, ...]) -> dict[str, int]:
    """Vocabulary keyed by byte-alphabet spelling (re-spelling the rare token stored as raw text)."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        key = token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, token_id)
    return vocab


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    key = pre or "default"
    if key not in SPLIT_PATTERNS:
        raise UnsupportedModelFeature(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(SPLIT_PATTERNS)})")
    pattern = SPLIT_PATTERNS[key]
    if pattern is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if key in SINGLE_DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _added_tokens(vocab: GGUFVocab, spelled: dict[str, int]) -> list[AddedToken]:
    """Control tokens (special) and user-defined ones (matched whole, not special)."""
    added = []
    for token_id, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if kind not in (CONTROL_TOKEN, USER_DEFINED_TOKEN):
            continue
        if spelled.get(token) != token_id:
            # Its text is not a byte-level spelling: adding it would append a new id.
            logger.debug("skipping GGUF added token %r (id %d)", token, token_id)
            continue
        added.append(AddedToken(token, special=kind == CONTROL_TOKEN, normalized=False))
    return added


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    specials = []
    single = "$A"
    if vocab.add_bos_token and vocab.bos_token_id is not None:
        bos = vocab.tokens[vocab.bos_token_id]
        specials.append((bos, vocab.bos_token_id))
        single = f"{bos} {single}"
    if vocab.add_eos_token and vocab.eos_token_id is not None:
        eos = vocab.tokens[vocab.eos_token_id]
        specials.append((eos, vocab.eos_token_id))
        single = f"{single} {eos}"
    return processors.TemplateProcessing(single=single, special_tokens=specials) if specials else None


def build_gguf_backend(vocab: GGUFVocab) -> Backend:
    """The `tokenizers.Tokenizer` a GGUF vocabulary describes (byte-level BPE only)."""
    if vocab.model != "gpt2":
        raise UnsupportedModelFeature(
            f"GGUF tokenizer model {vocab.model!r} is not supported (only byte-level BPE 'gpt2')"
        )
    spelled = _spelled(vocab.tokens)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = models.BPE(vocab=spelled, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=vocab.pre in ("llama-bpe", "llama3"))
    backend = Backend(bpe)
    backend.pre_tokenizer = _pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    added = _added_tokens(vocab, spelled)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    post = _post_processor(vocab)
    if post is not None:
        backend.post_processor = post
    return backend
