"""A step whose requests are all aborted while it runs stops at the next layer (issue 22, part 4:
a client that leaves mid-prefill frees the worker within a step's layer, not a whole chunk).
Real engine (tiny Qwen3). The abort is sent from inside a layer of the running step, as the HTTP
thread's would arrive mid-step: the order is forced, not timed."""

from __future__ import annotations

import pytest

from pdserve.api.sampling import FinishReason
from pdserve.kv.hashing import hash_full_blocks
from pdserve.request import GenerationRequest
from tests.engine.harness import Collected, generate, greedy, make_engine
from tests.tiny_models import make_tiny_qwen3

PROMPT = [11 + (5 * j) % 250 for j in range(24)]
OTHER = [7 + (3 * j) % 250 for j in range(24)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return make_engine(directory, block_size=4, num_blocks=256)


def abort_from_layer(monkeypatch, built, layer_index: int, request_id: str) -> list[int]:
    """Make layer `layer_index` abort `request_id` the first time it runs; returns per-layer call counts."""
    layers = built.runner.model.layers
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        original = layer.forward

        def counted(*args, _index=index, _original=original, **kwargs):
            calls[_index] += 1
            if _index == layer_index and calls[_index] == 1:
                built.engine.engine_loop.abort(request_id)
            return _original(*args, **kwargs)

        monkeypatch.setattr(layer, "forward", counted)
    return calls


def test_a_step_whose_only_request_is_aborted_stops_at_the_next_layer_and_caches_nothing(engine, monkeypatch):
    clean = generate(engine, [PROMPT], greedy(6), prefix="clean")[0]
    loop = engine.engine.engine_loop
    engine.engine.request_ids.reserve("leaver")
    calls = abort_from_layer(monkeypatch, engine, 0, "leaver")
    leaver = Collected()
    loop.submit(GenerationRequest("leaver", tuple(OTHER), greedy(6)), leaver.outputs.append)
    loop.run_until_idle()
    monkeypatch.undo()
    assert leaver.final.finished and leaver.final.finish_reason is FinishReason.ABORT
    assert leaver.token_ids == []
    assert calls[0] == 1 and calls[1:] == [0] * (len(calls) - 1), calls  # the rest of the stack never ran
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.pool.num_in_use_by_group(0) == 0
    assert len(engine.engine.request_ids) == 0
    # Nothing of the abandoned pass reached the prefix cache: the same prompt is computed afresh.
    assert engine.kv_manager.find_prefix(_hashes(engine, OTHER), len(OTHER)).num_tokens == 0
    again = generate(engine, [PROMPT], greedy(6), prefix="again")[0]
    assert again.token_ids == clean.token_ids


def test_a_step_with_a_request_still_wanted_runs_to_the_end(engine, monkeypatch):
    clean = generate(engine, [PROMPT], greedy(6), prefix="clean2")[0]
    loop = engine.engine.engine_loop
    for request_id in ("stayer", "goner"):
        engine.engine.request_ids.reserve(request_id)
    calls = abort_from_layer(monkeypatch, engine, 0, "goner")
    stayer, goner = Collected(), Collected()
    loop.submit(GenerationRequest("stayer", tuple(PROMPT), greedy(6)), stayer.outputs.append)
    loop.submit(GenerationRequest("goner", tuple(OTHER), greedy(6)), goner.outputs.append)
    loop.run_until_idle()
    monkeypatch.undo()
    assert stayer.token_ids == clean.token_ids and stayer.final.finish_reason is FinishReason.LENGTH
    assert goner.final.finish_reason is FinishReason.ABORT
    assert calls[-1] >= 1  # the shared step ran through every layer
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.pool.num_in_use_by_group(0) == 0
    assert len(engine.engine.request_ids) == 0


def _hashes(built, token_ids: list[int]) -> list[bytes]:
    return hash_full_blocks(token_ids, built.kv_manager.block_size, [])
