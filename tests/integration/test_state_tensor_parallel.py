"""The recurrent-state families at TP=2 as real processes (gloo between the ranks): a tiny Qwen3.5
(Gated DeltaNet: one key head and two value heads a rank) and a tiny Nemotron-H (Mamba2: two heads
and one group a rank) served by `pdserve serve -tp 2`, each rank's pool holding its share of the
state, give transformers' greedy tokens for prompts shorter and longer than a prefill chunk."""

from __future__ import annotations

import pytest

from tests.integration.cluster import start_workers, stop_all
from tests.integration.test_tensor_parallel import NUM_NEW, assert_greedy_parity, greedy, tp_worker
from tests.models.hf_oracle import hf_greedy_with_margins
from tests.tiny_models import NEMOTRON_H_VOCAB, QWEN3_5_VOCAB, make_tiny_nemotron_h, make_tiny_qwen3_5, random_prompt

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

FAMILIES = {"qwen3_5": (make_tiny_qwen3_5, QWEN3_5_VOCAB), "nemotron_h": (make_tiny_nemotron_h, NEMOTRON_H_VOCAB)}
CHUNK_TOKENS = 32  # the longer prompt goes in three prefill chunks: the state crosses chunk boundaries


@pytest.fixture(scope="module")
def state_tp2(tmp_path_factory):
    """{family: (oracle, vocab, TP=2 serve worker)}."""
    logs = tmp_path_factory.mktemp("state-tp-logs")
    found = {}
    for family, (make, vocab) in FAMILIES.items():
        directory = str(tmp_path_factory.mktemp(family))
        worker = tp_worker("serve", directory, logs, family, "-tp", "2", "--max-num-batched-tokens",
                           str(CHUNK_TOKENS))
        found[family] = (make(directory), vocab, worker)
    start_workers(*(worker for _, _, worker in found.values()))
    yield found
    stop_all(*(worker for _, _, worker in found.values()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_models_at_tp2_greedy_match_transformers(state_tp2, family):
    oracle, vocab, worker = state_tp2[family]
    for seed, length in ((1, 9), (2, 2 * CHUNK_TOKENS + 13)):
        prompt = random_prompt(length, vocab, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        assert_greedy_parity(greedy(worker, prompt), want, margins)
    assert worker.metric("pdserve_engine_tensor_parallel_ranks") == 2
