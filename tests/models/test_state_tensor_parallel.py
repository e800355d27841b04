"""Tensor parallelism for the recurrent-state families, in one process: two ranks (threads over
in-process collectives, as tests/models/test_moe_tensor_parallel.py runs them) of a tiny Qwen3.5
(Gated DeltaNet) and a tiny Nemotron-H (Mamba2) declare their share of the state, give the one-rank
model's and transformers' logits with the prompt in chunks, and generate transformers' greedy tokens;
sizes that do not divide the state heads or groups, and the MoE variants, are refused naming why."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.hf_config import UnsupportedModelFeature
from pdserve.models.loader import load_model
from pdserve.models.registry import TensorParallelRank, build_model
from pdserve.models.weights import SafetensorsSource
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits
from tests.models.test_moe_tensor_parallel import ThreadCollectives, load_ranks
from tests.tiny_models import (
    NEMOTRON_H_MOE_SETTINGS, NEMOTRON_H_VOCAB, QWEN3_5_VOCAB, make_tiny_nemotron_h, make_tiny_qwen3_5,
    random_prompt, tiny_qwen3_next_config)

pytest.importorskip("transformers")
CPU = torch.device("cpu")
CHUNK_TOKENS = 24  # prompts of 70 tokens go in three chunks: the state crosses chunk boundaries
VOCABS = {"qwen3_5": QWEN3_5_VOCAB, "nemotron_h": NEMOTRON_H_VOCAB}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers oracle, directory)}. Qwen3.5: 2 key heads, 4 value heads; Nemotron-H:
    4 Mamba2 heads in 2 groups, with in/out projection biases (rank 0 adds out_proj's)."""
    qwen_dir, nemotron_dir = (str(tmp_path_factory.mktemp(n)) for n in ("qwen3_5", "nemotron_h"))
    return {"qwen3_5": (make_tiny_qwen3_5(qwen_dir), qwen_dir),
            "nemotron_h": (make_tiny_nemotron_h(nemotron_dir, use_bias=True), nemotron_dir)}


@pytest.fixture(scope="module")
def rank_models(checkpoints):
    return {family: load_ranks(directory) for family, (_, directory) in checkpoints.items()}


def run_ranks(models: list, work) -> list:
    """work(model) on every rank at once, as threads (their collectives wait for each other)."""
    results: list = [None] * len(models)

    def run(rank: int) -> None:
        results[rank] = work(models[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(result is not None for result in results), "a rank failed; see the thread's traceback above"
    return results


def chunked_prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    attention = ContiguousAttention(model.spec.layer_specs)
    return torch.cat([forward_chunk(model, attention, "s", prompt[i : i + CHUNK_TOKENS])
                      for i in range(0, len(prompt), CHUNK_TOKENS)])


def test_each_rank_declares_its_share_of_every_state_layer(checkpoints, rank_models):
    expected = {  # (conv channels, recurrent shape) of one rank at TP=2
        "qwen3_5": (2 * 1 * 16 + 2 * 16, (2, 16, 16)),  # 1 key head (q, k) + 2 value heads; state per value head
        "nemotron_h": (2 * 16 + 2 * 1 * 16, (2, 16, 16)),  # 2 heads' x + 1 group's B and C
    }
    for family, models in rank_models.items():
        whole = load_model(checkpoints[family][1], torch.float32, CPU).model
        for model in models:
            states = [spec for spec in model.spec.layer_specs if isinstance(spec, RecurrentStateSpec)]
            whole_states = [spec for spec in whole.spec.layer_specs if isinstance(spec, RecurrentStateSpec)]
            assert len(states) == len(whole_states) == 3
            assert all((s.conv_channels, s.recurrent_shape) == expected[family] for s in states)
            assert all(s.conv_window == w.conv_window and s.dtype == w.dtype for s, w in zip(states, whole_states))
            assert whole_states[0].conv_channels == 2 * expected[family][0]
            assert model.spec.tensor_parallel_size == 2


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_two_ranks_give_the_one_rank_and_transformers_logits_with_the_prompt_in_chunks(
        checkpoints, rank_models, family):
    oracle, directory = checkpoints[family]
    prompt = random_prompt(70, VOCABS[family], 11)
    expected = hf_prompt_logits(oracle, prompt)
    whole = load_model(directory, torch.float32, CPU).model
    torch.testing.assert_close(chunked_prompt_logits(whole, prompt), expected, atol=1e-4, rtol=1e-4)
    for logits in run_ranks(rank_models[family], lambda model: chunked_prompt_logits(model, prompt)):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_two_ranks_generate_transformers_greedy_tokens(checkpoints, rank_models, family):
    oracle, _ = checkpoints[family]
    prompt = random_prompt(50, VOCABS[family], 5)
    expected = hf_greedy_generate(oracle, prompt, 12)
    generated = run_ranks(rank_models[family], lambda model: greedy_generate(model, prompt, 12, CHUNK_TOKENS))
    assert generated == [expected, expected]


def _build_rank(config: dict, directory: str, size: int):
    with SafetensorsSource(directory) as source:
        return build_model(config, source, torch.float32, CPU,
                           parallel=TensorParallelRank(0, size, lambda t: t, lambda t: t))


def test_a_size_that_does_not_divide_the_state_heads_or_groups_is_refused_naming_the_counts(checkpoints):
    # TP=4 divides the attention heads (4), replicates the 2 KV heads and divides the MLPs, but not
    # the 2 DeltaNet key heads or the 2 Mamba2 groups.
    directory = checkpoints["qwen3_5"][1]
    config = json.load(open(os.path.join(directory, "config.json")))
    with pytest.raises(UnsupportedModelFeature, match="4 does not divide the model's 2 Gated DeltaNet key heads"):
        _build_rank(config, directory, 4)
    directory = checkpoints["nemotron_h"][1]
    config = json.load(open(os.path.join(directory, "config.json")))
    with pytest.raises(UnsupportedModelFeature, match="4 does not divide the model's 2 Mamba2 groups"):
        _build_rank(config, directory, 4)
    config["mamba_num_heads"], config["n_groups"] = 6, 3
    with pytest.raises(UnsupportedModelFeature, match="2 does not divide the model's 3 Mamba2 groups"):
        _build_rank(config, directory, 2)


def test_the_mixture_of_experts_variants_are_refused_under_tensor_parallelism(checkpoints):
    directory = checkpoints["nemotron_h"][1]
    config = {**json.load(open(os.path.join(directory, "config.json"))), **NEMOTRON_H_MOE_SETTINGS}
    with pytest.raises(UnsupportedModelFeature, match="Nemotron-H's mixture-of-experts blocks"):
        _build_rank(config, directory, 2)
    directory = checkpoints["qwen3_5"][1]
    config = tiny_qwen3_next_config().to_dict()
    config["architectures"] = ["Qwen3NextForCausalLM"]
    with pytest.raises(UnsupportedModelFeature, match="qwen3_next's mixture-of-experts layers"):
        _build_rank(config, directory, 2)
