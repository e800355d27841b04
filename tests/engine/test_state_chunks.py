"""A hybrid model's prefill chunks end on block boundaries and at the prompt's last full block."""

from __future__ import annotations

from hypothesis import given, strategies as st

from pdserve.engine.state_chunks import is_snapshot_point, last_full_block_end, snapshot_chunk_tokens


def _chunks(num_prompt_tokens: int, budget: int, block_size: int) -> list[tuple[int, int]]:
    computed, chunks = 0, []
    while computed < num_prompt_tokens:
        size = snapshot_chunk_tokens(computed, min(budget, num_prompt_tokens - computed), num_prompt_tokens, block_size)
        chunks.append((computed, computed + size))
        computed += size
    return chunks


def test_the_docstring_example():
    assert _chunks(70, 40, 16) == [(0, 32), (32, 64), (64, 70)]
    assert [is_snapshot_point(end, 70, 16) for _, end in _chunks(70, 40, 16)] == [True, True, False]


def test_a_prompt_within_one_block_is_one_chunk():
    assert _chunks(10, 64, 16) == [(0, 10)]
    assert last_full_block_end(17, 16) == 16 and last_full_block_end(16, 16) == 0


@given(st.integers(1, 300), st.integers(1, 80), st.sampled_from([1, 4, 16]))
def test_chunks_cover_the_prompt_within_budget_and_stop_at_its_last_full_block(num_prompt_tokens, budget, block_size):
    chunks = _chunks(num_prompt_tokens, budget, block_size)
    assert chunks[0][0] == 0 and chunks[-1][1] == num_prompt_tokens
    assert all(0 < end - start <= budget for start, end in chunks)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    cut = last_full_block_end(num_prompt_tokens, block_size)
    if cut:
        assert cut in [end for _, end in chunks]
    # A chunk that is not the prompt's tail ends on a block boundary unless the budget is under a block.
    if budget >= block_size:
        assert all(end % block_size == 0 for _, end in chunks[:-1])
