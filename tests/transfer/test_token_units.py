"""token_units: the unit two block sizes share and the chunks of a page a unit read touches."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.transfer.token_units import (UnitGrid, block_size_problem, byte_chunk_ids, padded_unit_geometry,
                                          unit_chunk_ids, unit_geometry)


def test_block_sizes_pair_only_when_one_divides_the_other():
    assert block_size_problem(16, 32) is None
    assert block_size_problem(32, 16) is None
    assert block_size_problem(16, 16) is None
    assert "one must divide the other" in block_size_problem(16, 24)


def test_geometry_takes_the_shorter_row_as_the_unit():
    # 2 heads x 2 slots x K/V = 8 rows; rows of 16 tokens x 8 dims x 4 bytes = 512 bytes here, 1024 there.
    geometry = unit_geometry(8 * 512, 8, 8 * 1024, 8)
    assert geometry.unit_bytes == 512
    assert geometry.local == UnitGrid(rows_per_page=8, units_per_row=1)
    assert geometry.remote == UnitGrid(rows_per_page=8, units_per_row=2)
    assert geometry.remote.chunks_per_page == 16


@pytest.mark.parametrize("local, remote", [((4096, 7), (4096, 8)), ((8 * 512, 8), (8 * 768, 8))])
def test_geometry_refuses_pages_without_whole_rows_or_rows_that_do_not_divide(local, remote):
    with pytest.raises(ValueError):
        unit_geometry(*local, *remote)


def test_chunk_ids_walk_every_row_of_each_unit_at_its_slot():
    grid = UnitGrid(rows_per_page=4, units_per_row=2)  # 8 chunks per page: row r slot s at 2r + s
    # unit 7 = block 3, slot 1; unit 2 = block 1, slot 0; rows 1..2
    ids = unit_chunk_ids(grid, [7, 2], first_row=1, num_rows=2)
    assert ids.tolist() == [3 * 8 + 1 * 2 + 1, 3 * 8 + 2 * 2 + 1, 1 * 8 + 1 * 2 + 0, 1 * 8 + 2 * 2 + 0]


def test_chunk_ids_move_a_16_token_page_into_half_of_each_row_of_a_32_token_page():
    """Token positions, not bytes: a P page's rows land in the right half of D's rows, token for token."""
    rows, tokens_p, tokens_d = 3, 16, 32
    p_page = np.arange(rows * tokens_p).reshape(rows, tokens_p)  # row r holds tokens 0..15 of that row
    d_pool = np.full((2, rows, tokens_d), -1)
    geometry = unit_geometry(rows * tokens_d, rows, rows * tokens_p, rows)
    assert geometry.unit_bytes == 16
    # P block 0 (one unit per row) -> D block 1, second unit of each row (tokens 16..31).
    local = unit_chunk_ids(geometry.local, [1 * 2 + 1], 0, rows)
    remote = unit_chunk_ids(geometry.remote, [0], 0, rows)
    d_chunks, p_chunks = d_pool.reshape(-1, 16), p_page.reshape(-1, 16)
    d_chunks[local] = p_chunks[remote]
    assert (d_pool[1, :, 16:] == p_page).all()
    assert (d_pool[1, :, :16] == -1).all() and (d_pool[0] == -1).all()


def test_padded_pages_and_state_slots_cut_units_into_chunks_that_fit_all_of_them():
    # Rows of 80 bytes here (2 rows, a page of 512 padded), 320 there (a page of 640); state slots of 300.
    geometry = padded_unit_geometry(80, 2, 512, 320, 2, 640, slot_bytes=[300])
    assert geometry.unit_bytes == 80 and geometry.chunk_bytes == 4
    assert geometry.local == UnitGrid(2, 1, 20, 128) and geometry.remote == UnitGrid(2, 4, 20, 160)
    # Unit 1 of remote page 3 (tokens 4..7 of its rows): row 0 at chunk 3*160 + 1*20, row 1 four units on.
    ids = unit_chunk_ids(geometry.remote, [3 * 4 + 1], 0, 2)
    assert list(ids[:20]) == list(range(500, 520)) and list(ids[20:]) == list(range(580, 600))
    assert list(unit_chunk_ids(geometry.local, [5], 1, 1)) == list(range(5 * 128 + 20, 5 * 128 + 40))
    # A state slot is a run of whole chunks; anything else is refused.
    assert list(byte_chunk_ids(geometry.local, 4, 5, 200, 300)) == list(range(5 * 128 + 50, 5 * 128 + 125))
    with pytest.raises(ValueError, match="no run of whole chunks"):
        byte_chunk_ids(geometry.local, 4, 5, 2, 300)
    with pytest.raises(ValueError, match="no run of whole chunks"):
        byte_chunk_ids(geometry.local, 4, 5, 300, 300)  # past the page's end


def test_padded_geometry_without_padding_or_state_is_the_plain_one():
    padded, plain = padded_unit_geometry(512, 8, 8 * 512, 1024, 8, 8 * 1024), unit_geometry(8 * 512, 8, 8 * 1024, 8)
    assert (padded.unit_bytes, padded.chunk_bytes) == (plain.unit_bytes, plain.chunk_bytes) == (512, 512)
    for grid in ("local", "remote"):
        mine, theirs = getattr(padded, grid), getattr(plain, grid)
        assert (mine.chunks_per_page, mine.chunks_per_unit) == (theirs.chunks_per_page, 1)
        assert list(unit_chunk_ids(mine, [3, 9], 2, 4)) == list(unit_chunk_ids(theirs, [3, 9], 2, 4))
