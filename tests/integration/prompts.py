"""Prompts for P/D equality tests: token ids of real chat prompts whose length is one token
past a block boundary (see `same_path_reference` in tests/integration/cluster.py)."""

from __future__ import annotations

import functools


@functools.cache
def smollm2_tokenizer():
    """The embedded model's tokenizer alone (no weights): a few seconds, once per session."""
    from pdserve.models.gguf_file import GGUFCheckpoint
    from pdserve.models.loader import embedded_model_path
    from pdserve.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_vocab(GGUFCheckpoint(embedded_model_path()).vocab())


def aligned_chat_prompt(question: str, block_size: int = 16) -> list[int]:
    """The chat-templated question as token ids, its length one past a multiple of
    `block_size`: filler words go at the end of the question until it is."""
    tokenizer = smollm2_tokenizer()
    for num_fillers in range(4 * block_size):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question + " please" * num_fillers}])
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if (len(token_ids) - 1) % block_size == 0:
            return token_ids
    raise ValueError(f"no filler count aligns {question!r} to blocks of {block_size}")
