"""Chained block hashes: deterministic across processes, extended incrementally."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kv.hashing import HASH_BYTES, hash_block_tokens, hash_full_blocks


def test_block_hash_is_identical_in_a_fresh_process():
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], b"model-a")
    code = (
        "from pdserve.kv.hashing import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3]), [4, 5, 6], b'model-a').hex())"
    )
    # A different hash seed proves nothing depends on Python's per-process hash().
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": root}
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert there.stdout.strip() == here.hex()
    assert len(here) == HASH_BYTES


def test_block_hash_depends_on_parent_tokens_and_extra():
    root = hash_block_tokens(None, [1, 2])
    variants = {
        root,
        hash_block_tokens(root, [1, 2]),
        hash_block_tokens(None, [2, 1]),
        hash_block_tokens(None, [1, 2, 0]),
        hash_block_tokens(None, [1, 2], b"x"),
        hash_block_tokens(b"", [1, 2]),
    }
    assert len(variants) == 6
    assert hash_block_tokens(None, [1, 2]) == root


def test_block_hash_handles_large_token_ids_and_rejects_non_integers():
    assert hash_block_tokens(None, [262_143]) != hash_block_tokens(None, [262_143 % 65_536])
    with pytest.raises(ValueError):
        hash_block_tokens(None, [1 << 70])


def test_full_blocks_are_hashed_as_a_chain_and_partial_block_is_not():
    tokens = list(range(10))
    chain = hash_full_blocks(tokens, 4, [])
    assert len(chain) == 2
    assert chain[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert chain[1] == hash_block_tokens(chain[0], [4, 5, 6, 7])


def test_extending_a_chain_matches_hashing_from_scratch_and_keeps_existing():
    tokens = list(range(100, 140))
    existing = hash_full_blocks(tokens[:13], 4, [])
    before = list(existing)
    extended = hash_full_blocks(tokens, 4, existing)
    assert existing == before  # the caller's list is not mutated
    assert extended == hash_full_blocks(tokens, 4, [])
    assert extended[: len(existing)] == existing and len(extended) == 10


def test_chains_of_different_prefixes_diverge_from_the_first_different_block():
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 2, [])
    b = hash_full_blocks([1, 2, 3, 4, 0, 6, 7, 8], 2, [])
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


def test_hash_full_blocks_rejects_bad_arguments():
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2, 3], 0, [])
    with pytest.raises(ValueError):
        hash_full_blocks([1, 2, 3], 2, [b"a", b"b"])  # only one full block exists


def test_the_compiled_chain_equals_chaining_single_block_hashes():
    import random

    rng = random.Random(7)
    for block_size in (1, 3, 16):
        tokens = [rng.randrange(0, 1 << 40) for _ in range(block_size * 9 + 2)]
        expected, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(parent, tokens[start:start + block_size], b"x")
            expected.append(parent)
        assert hash_full_blocks(tokens, block_size, [], b"x") == expected
        assert hash_full_blocks(tokens, block_size, expected[:4], b"x") == expected
    with pytest.raises(ValueError):
        hash_full_blocks([1 << 70] * 4, 4, [])
