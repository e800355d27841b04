"""The embedded SmolLM2 GGUF, loaded by us, against transformers loading the
same file with its own dequantizer: prompt logits and greedy chat decoding."""

from __future__ import annotations

import pytest
import torch

from tests.models.contiguous_attention import ContiguousAttention, forward_chunk, greedy_generate
from tests.models.hf_oracle import hf_greedy_generate, hf_prompt_logits
from pdserve.kv.specs import FullAttentionSpec
from pdserve.models.loader import EMBEDDED_MODEL_NAME, load_model

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about autumn leaves."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "List three prime numbers greater than 10."},
    ],
]
NUM_GENERATED = 32


def _chat_ids(smollm2, messages) -> list[int]:
    return smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_embedded_model_has_smollm2_geometry_and_name(smollm2):
    spec = smollm2.model.spec
    assert smollm2.name == EMBEDDED_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("llama", 30, 576)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (9, 3, 64, 49152)
    assert spec.layer_specs == (FullAttentionSpec(),) * 30
    assert smollm2.tokenizer.eos_token_ids == (2,)
    assert smollm2.tokenizer.bos_token_id == 1


def test_prompt_logits_match_transformers(smollm2, hf_smollm2_model):
    prompt_ids = _chat_ids(smollm2, CHATS[0])
    ours = forward_chunk(smollm2.model, ContiguousAttention(smollm2.model.spec.layer_specs), "s", prompt_ids)
    theirs = hf_prompt_logits(hf_smollm2_model, prompt_ids)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
def test_greedy_chat_decoding_matches_transformers_token_for_token(smollm2, hf_smollm2_model, chat_index):
    prompt_ids = _chat_ids(smollm2, CHATS[chat_index])
    ours = greedy_generate(smollm2.model, prompt_ids, NUM_GENERATED, chunk_tokens=16 if chat_index == 1 else None)
    theirs = hf_greedy_generate(hf_smollm2_model, prompt_ids, NUM_GENERATED)
    assert ours == theirs, (smollm2.tokenizer.decode(ours), smollm2.tokenizer.decode(theirs))


def test_first_answer_is_sensible(smollm2):
    prompt_ids = _chat_ids(smollm2, CHATS[0])
    answer = smollm2.tokenizer.decode(greedy_generate(smollm2.model, prompt_ids, 8))
    assert "Paris" in answer


def test_flat_batch_of_two_sequences_matches_each_run_alone(smollm2):
    """Two requests in one flat batch (one mid-prefill, one decoding) give the
    logits each gets alone: positions and request boundaries are respected."""
    model = smollm2.model
    first, second = _chat_ids(smollm2, CHATS[0]), _chat_ids(smollm2, CHATS[2])
    alone_first = forward_chunk(model, ContiguousAttention(model.spec.layer_specs), "a", first)
    alone_ctx = ContiguousAttention(model.spec.layer_specs)
    forward_chunk(model, alone_ctx, "b", second[:-1])
    alone_second = forward_chunk(model, alone_ctx, "b", second[-1:])

    batched = ContiguousAttention(model.spec.layer_specs)
    forward_chunk(model, batched, "b", second[:-1])
    ids = torch.tensor(first + second[-1:])
    positions = torch.cat([torch.arange(len(first)), torch.tensor([len(second) - 1])])
    batched.set_batch(["a", "b"], [len(first), 1])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, batched))
    torch.testing.assert_close(logits[: len(first)], alone_first, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[len(first) :], alone_second, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_runs_on_cpu_and_agrees_on_next_token(smollm2):
    bf16 = load_model(None, torch.bfloat16, torch.device("cpu"))
    prompt_ids = _chat_ids(smollm2, CHATS[0])
    logits = forward_chunk(bf16.model, ContiguousAttention(bf16.model.spec.layer_specs), "s", prompt_ids)
    reference = forward_chunk(smollm2.model, ContiguousAttention(smollm2.model.spec.layer_specs), "s", prompt_ids)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert int(logits[-1].argmax()) == int(reference[-1].argmax())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_cuda_agrees_with_fp32_cpu_on_next_tokens(smollm2, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpu = load_model(None, dtype, torch.device("cuda"))
    embedding = gpu.model.embed_tokens.weight
    assert embedding.dtype == dtype and embedding.is_cuda
    prompt_ids = _chat_ids(smollm2, CHATS[0])
    logits = forward_chunk(gpu.model, ContiguousAttention(gpu.model.spec.layer_specs), "s", prompt_ids)
    reference = forward_chunk(smollm2.model, ContiguousAttention(smollm2.model.spec.layer_specs), "s", prompt_ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert int(logits[-1].argmax()) == int(reference[-1].argmax())
    assert greedy_generate(gpu.model, prompt_ids, 4) == greedy_generate(smollm2.model, prompt_ids, 4)
