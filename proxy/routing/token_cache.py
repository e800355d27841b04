"""Tokenizing prompts in the proxy, remembering the pieces between special tokens.

Invariant: `encode(text)` equals `tokenizer.encode(text, add_special_tokens=False).ids`.
The tokenizers library splits a text at its added (special) tokens first and
runs normalization, pre-tokenization and the model on each piece on its own,
so a piece's ids depend only on the piece and on whether it starts the text
(some pre-tokenizers treat the first piece specially). A rendered chat repeats
the earlier turns of its conversation, so their pieces come from the cache and
only new text is tokenized. Each piece is encoded behind the added token that
precedes it (that token's id is dropped) to keep the "not first" context
exact. Tokenizers whose added tokens strip neighbouring whitespace or match
on normalized text do not split that simply: they are encoded whole, uncached.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Optional

import tokenizers

# Text longer than this is tokenized off the event loop (the library's async
# call releases the GIL); shorter text costs less than the thread hand-off.
ASYNC_MIN_CHARS = 4096
MAX_CACHED_PIECES = 16384
MAX_CACHED_CHARS = 16 << 20


class SegmentTokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, max_pieces: int = MAX_CACHED_PIECES,
                 max_chars: int = MAX_CACHED_CHARS):
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        self.splits_simply = bool(added) and all(
            not (token.lstrip or token.rstrip or token.single_word)
            and not (token.normalized and tokenizer.normalizer is not None)
            for token in added.values())
        # Leftmost, then longest: how the library matches added tokens.
        contents = sorted(self._added_ids, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._pieces: OrderedDict[tuple[Optional[str], str], tuple[int, ...]] = OrderedDict()
        self._max_pieces = max_pieces
        self._max_chars = max_chars
        self._num_chars = 0
        self.num_hits = 0
        self.num_misses = 0

    async def encode(self, text: str) -> list[int]:
        if not self.splits_simply or self._splitter is None:
            return await self._encode_whole(text)
        ids: list[int] = []
        previous: Optional[str] = None
        for index, part in enumerate(self._splitter.split(text)):
            if index % 2:  # an added token
                ids.append(self._added_ids[part])
                previous = part
            elif part:
                ids.extend(await self._piece(previous, part))
        return ids

    async def _encode_whole(self, text: str) -> list[int]:
        if len(text) >= ASYNC_MIN_CHARS:
            return (await self.tokenizer.async_encode(text, add_special_tokens=False)).ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    async def _piece(self, previous: Optional[str], piece: str) -> tuple[int, ...]:
        key = (previous, piece)
        cached = self._pieces.get(key)
        if cached is not None:
            self._pieces.move_to_end(key)
            self.num_hits += 1
            return cached
        self.num_misses += 1
        ids = await self._encode_whole(piece if previous is None else previous + piece)
        encoded = tuple(ids if previous is None else ids[1:])
        self._remember(key, encoded)
        return encoded

    def _remember(self, key: tuple[Optional[str], str], ids: tuple[int, ...]) -> None:
        size = len(key[1])
        if size > self._max_chars // 16:
            return  # one huge piece would evict everything else
        self._pieces[key] = ids
        self._num_chars += size
        while len(self._pieces) > self._max_pieces or self._num_chars > self._max_chars:
            (_, old_piece), _ = self._pieces.popitem(last=False)
            self._num_chars -= len(old_piece)
