"""Tiny random checkpoints in the Hugging Face layout for benchmarks (and the model tests): the
word-level tokenizer whose ids cover any vocabulary, and saving a model with it.

Invariant: ids 0-2 are <unk>, <eos> and <bos>; every other id below the vocabulary size is a word.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers


def write_word_tokenizer(directory: str, vocab_size: int, eos_token_ids: Sequence[int] = (1,)) -> None:
    """A word-level tokenizer.json whose ids cover the model's vocabulary, plus
    tokenizer_config.json (special tokens, a chat template) and generation_config.json."""
    vocab = {"<unk>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": {"content": "<eos>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(eos_token_ids)}, f)


def save_tiny_checkpoint(hf_model, directory: str, max_shard_size: str | None = None) -> str:
    """`hf_model` (a transformers model) as safetensors, with the word tokenizer."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_word_tokenizer(directory, hf_model.config.vocab_size)
    return directory
