"""Tensor parallelism for the recurrent-state families, in one process: two ranks (threads over
in-process collectives, as tests/models/test_moe_tensor_parallel.py runs them) of a tiny Qwen3.5
(Gated DeltaNet) and a tiny Nemotron-H (Mamba2), and their mixture-of-experts variants Qwen3-Next and
Nemotron-H with MoE blocks (latent experts, biases), declare their share of the state, give the
one-rank model's and transformers' logits with the prompt in chunks, and generate transformers'
greedy tokens; sizes that do not divide the state heads, groups or expert widths are refused naming
the counts. Real processes over gloo: tests/integration/test_state_tensor_parallel.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature
from pdserve.models.loader import load_model
from pdserve.models.registry import TensorParallelRank, build_model
from pdserve.models.weights import SafetensorsSource
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits, save_tiny_checkpoint
from tests.models.test_moe_tensor_parallel import ThreadCollectives, load_ranks
from tests.tiny_models import (
    NEMOTRON_H_VOCAB, QWEN3_5_VOCAB, make_tiny_nemotron_h, make_tiny_nemotron_h_moe, make_tiny_qwen3_5,
    make_tiny_qwen3_next, random_prompt)

pytest.importorskip("transformers")
CPU = torch.device("cpu")
CHUNK_TOKENS = 24  # prompts of 70 tokens go in three chunks: the state crosses chunk boundaries
VOCABS = {"qwen3_5": QWEN3_5_VOCAB, "nemotron_h": NEMOTRON_H_VOCAB, "qwen3_next": QWEN3_5_VOCAB,
          "nemotron_h_moe": NEMOTRON_H_VOCAB}


def with_random_biases(model, directory: str):
    """transformers starts biases at zero, where a bias added by every rank (not once) would not show."""
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    save_tiny_checkpoint(model, directory)
    return model


MAKERS = {  # Qwen3-Next: 2 key heads, 4 value heads; Nemotron-H with MoE: 4 Mamba2 heads in 2 groups
    # 4 key heads, 8 value heads: two key heads a rank
    "qwen3_5": lambda directory: make_tiny_qwen3_5(directory, linear_num_key_heads=4, linear_num_value_heads=8),
    # 8 Mamba2 heads in 4 groups: two groups a rank; in/out projection biases (rank 0 adds out_proj's)
    "nemotron_h": lambda directory: with_random_biases(
        make_tiny_nemotron_h(directory, mamba_num_heads=8, n_groups=4, use_bias=True), directory),
    # 6 experts of 32 units, a shared expert of 64; attention biases ([query | gate] rows of q_proj's too)
    "qwen3_next": lambda directory: with_random_biases(make_tiny_qwen3_next(directory, attention_bias=True),
                                                       directory),
    # 8 experts of 32 units in a 16-wide latent space, a shared expert of 64, MLP and latent biases
    "nemotron_h_moe": lambda directory: with_random_biases(
        make_tiny_nemotron_h_moe(directory, moe_latent_size=16, mlp_bias=True), directory),
}
FAMILIES = sorted(MAKERS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers oracle, directory)}."""
    found = {}
    for family, make in MAKERS.items():
        directory = str(tmp_path_factory.mktemp(family))
        found[family] = (make(directory), directory)
    return found


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
        "qwen3_5": (2 * 2 * 16 + 4 * 16, (4, 16, 16)),  # 2 key heads (q, k) + 4 value heads; state per value head
        "qwen3_next": (2 * 1 * 16 + 2 * 16, (2, 16, 16)),
        "nemotron_h": (4 * 16 + 2 * 2 * 16, (4, 16, 16)),  # 4 heads' x + 2 groups' B and C
        "nemotron_h_moe": (2 * 16 + 2 * 1 * 16, (2, 16, 16)),
    }
    for family, models in rank_models.items():
        whole = load_model(checkpoints[family][1], torch.float32, CPU).model
        for model in models:
            states = [spec for spec in model.spec.layer_specs if isinstance(spec, RecurrentStateSpec)]
            whole_states = [spec for spec in whole.spec.layer_specs if isinstance(spec, RecurrentStateSpec)]
            assert len(states) == len(whole_states) >= 2
            assert all((s.conv_channels, s.recurrent_shape) == expected[family] for s in states)
            assert all(s.conv_window == w.conv_window and s.dtype == w.dtype for s, w in zip(states, whole_states))
            assert whole_states[0].conv_channels == 2 * expected[family][0]
            assert model.spec.tensor_parallel_size == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_the_one_rank_and_transformers_logits_with_the_prompt_in_chunks(
        checkpoints, rank_models, family):
    oracle, directory = checkpoints[family]
    prompt = random_prompt(70, VOCABS[family], 11)
    expected = hf_prompt_logits(oracle, prompt)
    whole = load_model(directory, torch.float32, CPU).model
    torch.testing.assert_close(chunked_prompt_logits(whole, prompt), expected, atol=1e-4, rtol=1e-4)
    for logits in run_ranks(rank_models[family], lambda model: chunked_prompt_logits(model, prompt)):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
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
    # TP=4 divides the attention heads (4), replicates the 2 KV heads and divides the MLPs and the
    # experts, but not Qwen3-Next's 2 DeltaNet key heads or this Nemotron-H's 2 Mamba2 groups.
    directory = checkpoints["qwen3_next"][1]
    config = json.load(open(os.path.join(directory, "config.json")))
    with pytest.raises(UnsupportedModelFeature, match="4 does not divide the model's 2 Gated DeltaNet key heads"):
        _build_rank(config, directory, 4)
    directory = checkpoints["nemotron_h_moe"][1]
    config = json.load(open(os.path.join(directory, "config.json")))
    with pytest.raises(UnsupportedModelFeature, match="4 does not divide the model's 2 Mamba2 groups"):
        _build_rank(config, directory, 4)
    config["mamba_num_heads"], config["n_groups"] = 6, 3
    with pytest.raises(UnsupportedModelFeature, match="2 does not divide the model's 3 Mamba2 groups"):
        _build_rank(config, directory, 2)


def test_an_expert_width_the_ranks_do_not_divide_is_refused_naming_it(checkpoints):
    for family, key in (("nemotron_h_moe", "moe_intermediate_size"), ("qwen3_next", "shared_expert_intermediate_size")):
        directory = checkpoints[family][1]
        config = json.load(open(os.path.join(directory, "config.json")))
        config[key] = 33
        with pytest.raises(ModelLoadError, match="does not divide the model's expert width 33"):
            _build_rank(config, directory, 2)
