"""The byte ranges a P/D pull between TP sizes moves (pdserve/transfer/state_ranges.py) follow the
models' own sharding: for a tiny Qwen3.5 (Gated DeltaNet: conv parts q, k, v) and a tiny Nemotron-H
(Mamba2: conv parts x, B, C), the state each of two ranks keeps after a prompt is the one-rank
model's state cut by `StateSplit.pieces`, and the one-rank state is the two ranks' states gathered
by them. A page slot holds a layer's state as the runner's views lay it out: the conv window, then
the recurrent tensor (kv/layout.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.loader import load_model
from pdserve.transfer.state_ranges import StateSplit, rank_state_spec
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.test_moe_tensor_parallel import load_ranks
from tests.models.test_state_tensor_parallel import MAKERS, VOCABS, run_ranks
from tests.tiny_models import random_prompt

pytest.importorskip("transformers")
FAMILIES = ("qwen3_5", "nemotron_h")
CHUNK_TOKENS = 24
FLOAT_BYTES = 4


def prompt_states(model, prompt: list[int]) -> dict[int, torch.Tensor]:
    """layer id -> the layer's state after the prompt, flat as in a page slot (conv window, then recurrent)."""
    attention = ContiguousAttention(model.spec.layer_specs)
    for start in range(0, len(prompt), CHUNK_TOKENS):
        forward_chunk(model, attention, "s", prompt[start:start + CHUNK_TOKENS])
    states = {}
    for layer_id, spec in enumerate(model.spec.layer_specs):
        if isinstance(spec, RecurrentStateSpec):
            conv, recurrent = attention.read_state(layer_id)
            states[layer_id] = torch.cat([conv[0].reshape(-1), recurrent[0].reshape(-1)])
    return states


def elements(state: torch.Tensor, offset_bytes: int, num_bytes: int) -> torch.Tensor:
    return state[offset_bytes // FLOAT_BYTES:(offset_bytes + num_bytes) // FLOAT_BYTES]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_state_is_the_whole_state_cut_by_the_split_and_the_ranks_gather_into_it(tmp_path, family):
    directory = str(tmp_path)
    MAKERS[family](directory)
    whole_model = load_model(directory, torch.float32, torch.device("cpu")).model
    rank_models = load_ranks(directory)
    prompt = random_prompt(50, VOCABS[family], 7)
    whole = prompt_states(whole_model, prompt)
    ranks = run_ranks(rank_models, lambda model: prompt_states(model, prompt))
    for layer_id, state in whole.items():
        spec = whole_model.spec.layer_specs[layer_id]
        split = StateSplit.of(spec, 1)
        assert spec.conv_parts and StateSplit.of(rank_models[0].spec.layer_specs[layer_id], 2) == split
        assert rank_models[0].spec.layer_specs[layer_id] == rank_state_spec(spec, 1, 2)
        for rank, rank_states in enumerate(ranks):
            pieces = split.pieces(rank, 2, 1)
            assert sum(piece.num_bytes for piece in pieces) == split.rank_bytes(2) == rank_states[layer_id].numel() * 4
            assert len(pieces) == len(split.part_rows)  # one range of the whole slot per part
            for piece in pieces:
                torch.testing.assert_close(elements(rank_states[layer_id], piece.local_offset_bytes, piece.num_bytes),
                                           elements(state, piece.remote_offset_bytes, piece.num_bytes),
                                           atol=1e-4, rtol=1e-4)
        gathered = torch.full_like(state, float("nan"))
        for piece in split.pieces(0, 1, 2):
            elements(gathered, piece.local_offset_bytes, piece.num_bytes)[:] = elements(
                ranks[piece.remote_rank][layer_id], piece.remote_offset_bytes, piece.num_bytes)
        torch.testing.assert_close(gathered, state, atol=1e-4, rtol=1e-4)
