"""Tiny random Qwen3.5 (three Gated DeltaNet layers and one gated full-attention layer with partial RoPE)
and Qwen3-Next (the same with shared-expert MoE, one dense layer) saved by transformers and loaded by
our loader: prompt logits and greedy tokens against transformers in float32 with prompts longer than
a scan chunk, fed whole, in chunks that end off the scan's chunk boundaries, and batched with another
sequence in one flat pass; plus the scans against the plain recurrence, and the config refusals."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec
from pdserve.models.gated_delta_net import delta_rule_chunked, delta_rule_step, gated_delta_rule
from pdserve.models.hf_config import UnsupportedModelFeature, flat_rope
from pdserve.models.layers import GatedMLP
from pdserve.models.loader import load_model
from pdserve.models.moe import SparseMoE
from pdserve.models.qwen3_5 import GatedAttentionLayer, GatedDeltaNetLayer, SharedExpertMoE, qwen3_5_args
from pdserve.models.rope import apply_rotary
from tests.devices import cuda_available
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits
from tests.tiny_models import (
    QWEN3_5_VOCAB, QWEN3_NEXT_DENSE_LAYERS, make_tiny_qwen3_5, make_tiny_qwen3_next, random_prompt,
    tiny_qwen3_5_config,
)

pytest.importorskip("transformers")
CPU = torch.device("cpu")
PROMPT_TOKENS = 150  # longer than two 64-row scan chunks
FAMILIES = ["qwen3_5", "qwen3_next"]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_5"))
    hf_model = make_tiny_qwen3_5(directory)
    return hf_model, load_model(directory, torch.float32, CPU).model, directory


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_next"))
    hf_model = make_tiny_qwen3_next(directory)
    return hf_model, load_model(directory, torch.float32, CPU).model, directory


def test_linear_layers_hold_a_delta_net_state_and_the_last_layer_attends(qwen3_5):
    _, ours, _ = qwen3_5
    state = RecurrentStateSpec(kind="gated_delta_net", conv_channels=2 * 2 * 16 + 4 * 16, conv_window=3,
                               recurrent_shape=(4, 16, 16), dtype="float32", conv_parts=(32, 32, 64))  # q, k, v
    assert ours.spec.layer_specs == (state, state, state, FullAttentionSpec())
    assert (ours.spec.num_kv_heads, ours.spec.head_dim, ours.spec.architecture) == (2, 32, "qwen3_5")
    assert [type(layer) for layer in ours.layers] == [GatedDeltaNetLayer] * 3 + [GatedAttentionLayer]
    assert ours.rotary.cos.shape[-1] == 4  # a quarter of 32 head dims rotate: 4 frequencies


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_longer_than_a_scan_chunk_gives_transformers_logits(family, request):
    hf_model, ours, _ = request.getfixturevalue(family)
    prompt = random_prompt(PROMPT_TOKENS, QWEN3_5_VOCAB, 1)
    ours_logits = forward_chunk(ours, ContiguousAttention(ours.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(ours_logits, hf_prompt_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_tokens", [None, 37])
def test_greedy_decoding_matches_transformers(family, chunk_tokens, request):
    hf_model, ours, _ = request.getfixturevalue(family)
    prompt = random_prompt(PROMPT_TOKENS, QWEN3_5_VOCAB, 3)
    expected = hf_greedy_generate(hf_model, prompt, 20)
    assert greedy_generate(ours, prompt, 20, chunk_tokens=chunk_tokens) == expected


def _flat_pass(model, context: ContiguousAttention, rows: Sequence[tuple[str, list[int]]]) -> dict[str, int]:
    """One forward over several sequences' rows back to back -> each sequence's greedy next token."""
    ids, positions, ends = [], [], []
    for seq_id, tokens in rows:
        start = context.num_cached(seq_id)
        ids += tokens
        positions += range(start, start + len(tokens))
        ends.append(len(ids) - 1)
    context.set_batch([seq_id for seq_id, _ in rows], [len(tokens) for _, tokens in rows])
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                            context))
    return {seq_id: int(logits[end].argmax()) for (seq_id, _), end in zip(rows, ends)}


def _assert_flat_batches_decode_as_each_alone(ours) -> None:
    """Two prompts prefilled together, then one decoding while the other finishes its prompt (a mixed
    pass), then both decoding a row each in every pass."""
    prompt_a, prompt_b = random_prompt(70, QWEN3_5_VOCAB, 5), random_prompt(45, QWEN3_5_VOCAB, 6)
    num_new = 12
    context = ContiguousAttention(ours.spec.layer_specs, next(ours.parameters()).device)
    got = {"a": [], "b": []}
    first = _flat_pass(ours, context, [("a", prompt_a), ("b", prompt_b[:20])])
    got["a"].append(first["a"])
    mixed = _flat_pass(ours, context, [("a", [got["a"][-1]]), ("b", prompt_b[20:])])
    got["a"].append(mixed["a"])
    got["b"].append(mixed["b"])
    while len(got["b"]) < num_new:
        step = _flat_pass(ours, context, [("a", [got["a"][-1]]), ("b", [got["b"][-1]])])
        got["a"].append(step["a"])
        got["b"].append(step["b"])
    assert got["a"][:num_new] == greedy_generate(ours, prompt_a, num_new)
    assert got["b"] == greedy_generate(ours, prompt_b, num_new)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_sequences_in_one_flat_pass_decode_as_each_alone(family, request):
    _assert_flat_batches_decode_as_each_alone(request.getfixturevalue(family)[1])


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_greedy_tokens_and_flat_batches_match(family, request):
    """The scans and the conv in plain torch ops on the GPU, float32: transformers' tokens (on the CPU)."""
    hf_model, _, directory = request.getfixturevalue(family)
    ours = load_model(directory, torch.float32, torch.device("cuda")).model
    prompt = random_prompt(PROMPT_TOKENS, QWEN3_5_VOCAB, 3)
    expected = hf_greedy_generate(hf_model, prompt, 20)
    assert greedy_generate(ours, prompt, 20) == expected
    assert greedy_generate(ours, prompt, 20, chunk_tokens=37) == expected
    _assert_flat_batches_decode_as_each_alone(ours)


def test_qwen3_next_sparse_layers_carry_routed_and_shared_experts(qwen3_next):
    _, ours, _ = qwen3_next
    kinds = [type(layer.block.mlp) for layer in ours.layers]
    assert kinds == [GatedMLP if i in QWEN3_NEXT_DENSE_LAYERS else SharedExpertMoE for i in range(4)]
    assert isinstance(ours.layers[0].block.mlp.routed, SparseMoE)
    assert ours.spec.architecture == "qwen3_next"


def _random_scan_inputs(num_rows: int, heads: int = 3, key_dim: int = 8, value_dim: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(num_rows, heads, key_dim, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(num_rows, heads, key_dim, generator=generator), dim=-1)
    v = torch.randn(num_rows, heads, value_dim, generator=generator)
    g = -torch.rand(num_rows, heads, generator=generator) * 0.2
    beta = torch.rand(num_rows, heads, generator=generator)
    state = torch.randn(heads, key_dim, value_dim, generator=generator)
    return q, k, v, g, beta, state


def _step_by_step(q, k, v, g, beta, state):
    outputs = []
    for t in range(q.shape[0]):
        out, state = delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                     state.unsqueeze(0))
        outputs.append(out)
        state = state[0]
    return torch.cat(outputs), state


@pytest.mark.parametrize("chunk_tokens", [8, 16, 64])
def test_chunked_scan_equals_the_step_recurrence_from_a_nonzero_state(chunk_tokens):
    q, k, v, g, beta, state = _random_scan_inputs(37)
    expected_out, expected_state = _step_by_step(q, k, v, g, beta, state)
    out, final = delta_rule_chunked(q, k, v, g, beta, state, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=1e-5)


def test_a_flat_batch_scans_each_sequence_from_its_own_state():
    """Lengths 5, 1, 12 in one batch (one row of the middle sequence takes the batched step)."""
    q, k, v, g, beta, _ = _random_scan_inputs(18, seed=1)
    states = torch.randn(3, 3, 8, 5, generator=torch.Generator().manual_seed(2))
    starts = [0, 5, 6, 18]
    out, final = gated_delta_rule(q, k, v, g, beta, starts, states.clone())
    for i in range(3):
        rows = slice(starts[i], starts[i + 1])
        expected_out, expected_state = _step_by_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states[i])
        torch.testing.assert_close(out[rows], expected_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], expected_state, atol=1e-5, rtol=1e-5)


def test_an_unknown_layer_type_is_refused_by_name():
    config = tiny_qwen3_5_config().to_dict()
    config["layer_types"] = ["linear_attention", "mamba", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelFeature, match="'mamba'"):
        qwen3_5_args(config)


def test_partial_rotary_turns_only_the_leading_dims_and_other_families_still_refuse_it():
    x = torch.randn(3, 2, 16)
    angles = torch.rand(3, 1, 2)
    rotated = apply_rotary(x, angles.cos(), angles.sin())
    torch.testing.assert_close(rotated[..., :4], apply_rotary(x[..., :4], angles.cos(), angles.sin()))
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    llama_config = {"max_position_embeddings": 64,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    with pytest.raises(UnsupportedModelFeature, match="partial"):
        flat_rope(llama_config)
