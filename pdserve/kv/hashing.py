"""Chained content hashes of full KV blocks, the keys of the prefix cache.

Invariant: a block's hash depends only on its tokens, its parent's hash and
`extra`, encoded byte-for-byte the same on every host, so a prefill and a
decode worker (separate processes, maybe separate machines) agree on every key.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

# The personalisation string versions the hashing scheme: changing the encoding
# below must change it, so old and new workers never share keys by accident.
_PERSON = b"pdserve-kv-v1"
HASH_SCHEME = _PERSON.decode()  # advertised to proxies that compute the same hashes
HASH_BYTES = 32


def _framed(data: bytes) -> bytes:
    # A length prefix keeps (parent, extra, tokens) unambiguous when concatenated.
    return struct.pack("<Q", len(data)) + data


def _new_digest() -> Any:
    return hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)


def _digest(parent: bytes | None, framed_extra: bytes, framed_tokens: bytes, fresh: Any) -> bytes:
    """`fresh` is an unused digest of this scheme: copying one is cheaper than configuring a new one."""
    digest = fresh.copy()
    parent_part = b"\x00" if parent is None else b"\x01" + _framed(bytes(parent))
    digest.update(parent_part + framed_extra + framed_tokens)
    return digest.digest()


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one block: its parent's hash (None for the first block), its
    token ids and any `extra` key material (e.g. a model or adapter id)."""
    try:
        # Fixed little-endian int64 so the bytes do not depend on the host.
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int64 integers: {exc}") from None
    return _digest(parent, _framed(bytes(extra)), _framed(tokens), _new_digest())


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, existing: list[bytes], extra: bytes = b""
) -> list[bytes]:
    """Return the request's whole chain: `existing` (hashes of its first blocks,
    left untouched) followed by the hashes of blocks that became full since.

    A trailing partial block is never hashed: its content is still changing.
    Byte for byte what chaining `hash_block_tokens` gives, with the per-block
    packing compiled once (this runs for every prompt, on workers and proxies).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    if len(existing) > num_full_blocks:
        raise ValueError(
            f"{len(existing)} existing hashes but only {num_full_blocks} full blocks of {block_size} tokens"
        )
    chain = list(existing)
    if len(chain) == num_full_blocks:
        return chain
    # The tokens' length prefix and the tokens themselves, in one pack: _framed(tokens).
    pack_framed_tokens = struct.Struct(f"<Q{block_size}q").pack
    num_token_bytes = 8 * block_size
    framed_extra = _framed(bytes(extra))
    fresh = _new_digest()
    parent = chain[-1] if chain else None
    for index in range(len(chain), num_full_blocks):
        start = index * block_size
        try:
            framed_tokens = pack_framed_tokens(num_token_bytes, *token_ids[start : start + block_size])
        except struct.error as exc:
            raise ValueError(f"token ids must be int64 integers: {exc}") from None
        parent = _digest(parent, framed_extra, framed_tokens, fresh)
        chain.append(parent)
    return chain
