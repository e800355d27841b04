"""Tiny random Nemotron-H (three Mamba2 blocks, two MLP blocks, one attention block; random norms, A_log,
dt_bias and D) saved by transformers and loaded by our loader: prompt logits across more than one scan
chunk, greedy tokens with the prompt whole and in chunks, two sequences batched in one flat pass, and
the config's block types read and refused as they should be. A second one swaps MLP blocks for mixtures
of experts (grouped sigmoid routing with a correction bias, a shared expert, with and without a latent
projection)."""

from __future__ import annotations

import os
import shutil
from typing import Sequence

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec
from pdserve.models.hf_config import UnsupportedModelFeature
from pdserve.models.loader import load_model
from pdserve.models.nemotron_h import ATTENTION, MAMBA, MLP, nemotron_h_args
from pdserve.models.nemotron_h_ffn import MoEGeometry, sigmoid_group_top_k
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits
from tests.tiny_models import (
    NEMOTRON_H_VOCAB, make_tiny_nemotron_h, make_tiny_nemotron_h_moe, random_prompt, tiny_nemotron_h_config,
)

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("nemotron_h"))
    return make_tiny_nemotron_h(directory), directory


@pytest.fixture(scope="module")
def nemotron(nemotron_dir):
    hf_model, directory = nemotron_dir
    return hf_model, load_model(directory, torch.float32, CPU).model


@pytest.fixture(scope="module", params=[None, 32], ids=["moe", "moe_latent"])
def nemotron_moe(tmp_path_factory, request):
    directory = str(tmp_path_factory.mktemp("nemotron_h_moe"))
    hf_model = make_tiny_nemotron_h_moe(directory, moe_latent_size=request.param)
    return hf_model, load_model(directory, torch.float32, CPU).model


def _config(**overrides) -> dict:
    return tiny_nemotron_h_config(**overrides).to_dict()


def test_layer_ids_count_only_the_mamba_and_attention_blocks(nemotron):
    _, ours = nemotron
    state = RecurrentStateSpec(kind="mamba2", conv_channels=64 + 2 * 2 * 16, conv_window=3,
                               recurrent_shape=(4, 16, 16), dtype="float32", conv_parts=(64, 32, 32))  # x, B, C
    assert ours.spec.layer_specs == (state, FullAttentionSpec(), state, state)
    assert ours.spec.architecture == "nemotron_h" and ours.spec.num_layers == 4
    assert [getattr(block, "layer_id", None) for block in ours.layers] == [0, None, 1, 2, None, 3]


def test_prompt_longer_than_a_scan_chunk_gives_transformers_logits(nemotron):
    hf_model, ours = nemotron
    prompt = random_prompt(150, NEMOTRON_H_VOCAB, 1)
    logits = forward_chunk(ours, ContiguousAttention(ours.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(logits, hf_prompt_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_tokens", [None, 37])
def test_greedy_decoding_matches_transformers(nemotron, chunk_tokens):
    hf_model, ours = nemotron
    prompt = random_prompt(150, NEMOTRON_H_VOCAB, 3)
    assert greedy_generate(ours, prompt, 20, chunk_tokens=chunk_tokens) == hf_greedy_generate(hf_model, prompt, 20)


def test_weights_named_model_dot_load_like_backbone_dot(nemotron_dir, nemotron, tmp_path):
    """transformers saves the trunk as `backbone.`; its in-memory names (`model.`) load the same."""
    _, directory = nemotron_dir
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    assert any(name.startswith("backbone.") for name in tensors)
    save_file({name.replace("backbone.", "model.", 1): t for name, t in tensors.items()},
              str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(directory, "config.json"), tmp_path / "config.json")
    shutil.copy(os.path.join(directory, "tokenizer.json"), tmp_path / "tokenizer.json")
    renamed = load_model(str(tmp_path), torch.float32, CPU).model
    prompt = random_prompt(20, NEMOTRON_H_VOCAB, 2)
    expected = forward_chunk(nemotron[1], ContiguousAttention(nemotron[1].spec.layer_specs), "s", prompt)
    assert torch.equal(forward_chunk(renamed, ContiguousAttention(renamed.spec.layer_specs), "s", prompt), expected)


def _flat_pass(model, attention: ContiguousAttention, rows: dict[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """One forward over several sequences' rows back to back; each sequence's last-row logits."""
    seq_ids = list(rows)
    ids, positions = [], []
    for seq_id in seq_ids:
        start = attention.num_cached(seq_id)
        ids.extend(rows[seq_id])
        positions.extend(range(start, start + len(rows[seq_id])))
    attention.set_batch(seq_ids, [len(rows[s]) for s in seq_ids])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), attention))
    ends = torch.tensor([len(rows[s]) for s in seq_ids]).cumsum(0) - 1
    return {seq_id: logits[end] for seq_id, end in zip(seq_ids, ends.tolist())}


def test_two_sequences_in_one_flat_pass_decode_as_each_alone(nemotron):
    """Pass 1 prefills both; pass 2 finishes the long prompt beside the short one's first decode row
    (a mixed pass through the chunked scan); then both decode one row each per pass."""
    _, ours = nemotron
    long_prompt, short_prompt = random_prompt(150, NEMOTRON_H_VOCAB, 5), random_prompt(40, NEMOTRON_H_VOCAB, 6)
    attention = ContiguousAttention(ours.spec.layer_specs)
    last = _flat_pass(ours, attention, {"long": long_prompt[:70], "short": short_prompt})
    generated: dict[str, list[int]] = {"long": [], "short": [int(last["short"].argmax())]}
    last = _flat_pass(ours, attention, {"long": long_prompt[70:], "short": generated["short"][-1:]})
    generated["long"].append(int(last["long"].argmax()))
    generated["short"].append(int(last["short"].argmax()))
    for _ in range(12):
        last = _flat_pass(ours, attention, {seq_id: tokens[-1:] for seq_id, tokens in generated.items()})
        for seq_id, logits in last.items():
            generated[seq_id].append(int(logits.argmax()))
    assert generated["long"] == greedy_generate(ours, long_prompt, 13)
    assert generated["short"] == greedy_generate(ours, short_prompt, 14)


def test_legacy_spellings_of_the_block_types_read_alike():
    current = nemotron_h_args(_config())
    config = _config()
    del config["layers_block_type"]
    assert nemotron_h_args({**config, "hybrid_override_pattern": "M-*M-M"}).block_types == current.block_types
    legacy = ["mamba", "mlp", "attention", "mamba", "mlp", "mamba"]
    assert nemotron_h_args({**config, "layers_block_type": legacy}).block_types == current.block_types
    assert current.block_types == (MAMBA, MLP, ATTENTION, MAMBA, MLP, MAMBA)


def test_a_block_type_we_do_not_serve_is_refused_by_name():
    config = _config()
    config["layers_block_type"] = ["linear_attention", "cross_attention", "full_attention"]
    with pytest.raises(UnsupportedModelFeature, match="block 1 .*'cross_attention'"):
        nemotron_h_args(config)


def test_a_state_dtype_we_cannot_keep_is_refused():
    with pytest.raises(UnsupportedModelFeature, match="mamba_ssm_cache_dtype"):
        nemotron_h_args({**_config(), "mamba_ssm_cache_dtype": "float8_e4m3fn"})


def test_mixture_of_experts_blocks_give_transformers_logits_and_tokens(nemotron_moe):
    hf_model, ours = nemotron_moe
    assert ours.spec.num_layers == 3  # two Mamba2 blocks and one attention block; MoE and MLP hold no cache
    prompt = random_prompt(150, NEMOTRON_H_VOCAB, 1)
    logits = forward_chunk(ours, ContiguousAttention(ours.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(logits, hf_prompt_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    assert greedy_generate(ours, prompt, 20, chunk_tokens=37) == hf_greedy_generate(hf_model, prompt, 20)


def test_routing_keeps_the_best_groups_and_weighs_by_the_unshifted_scores():
    """Experts 0-1 | 2-3 | 4-5; one group kept. The correction bias lifts group 2 (experts 4, 5) over
    group 0, whose expert 0 scores highest alone; the weights are the sigmoid scores, renormalised."""
    geometry = MoEGeometry(num_experts=6, experts_per_token=2, intermediate_size=4, shared_intermediate_size=4,
                           latent_size=0, num_groups=3, top_groups=1, renormalize=True, routed_scaling_factor=2.0)
    logits = torch.tensor([[3.0, -3.0, 0.0, 0.0, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    weights, ids = sigmoid_group_top_k(logits, bias, geometry)
    assert sorted(ids[0].tolist()) == [4, 5]
    scores = torch.sigmoid(logits[0, ids[0]])
    torch.testing.assert_close(weights[0], 2.0 * scores / scores.sum())
