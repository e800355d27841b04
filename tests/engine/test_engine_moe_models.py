"""The engine (paged pool, hybrid KV groups, scheduler, chunked prefill, prefix cache) on tiny random
gpt-oss and Qwen3-MoE checkpoints, greedy, token for token against transformers: decode through the
fused native stack (sinks, native experts), through the per-op native kernel with sinks, and
through the gathered SDPA path other devices take."""

from __future__ import annotations

import pytest
import torch

import pdserve.runner.decode_attention as decode_attention
import pdserve.runner.decode_step as decode_step
import pdserve.runner.paged_attention as paged_attention
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec
from pdserve.models.loader import load_model
from pdserve.request import GenerationRequest
from tests.engine.harness import generate, generate_one_by_one, greedy, make_engine
from tests.models.hf_oracle import hf_greedy_generate
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import (
    GPT_OSS_VOCAB, GPT_OSS_WINDOW, QWEN_MOE_VOCAB, make_tiny_gpt_oss, make_tiny_qwen3_moe, random_prompt,
)

NUM_TOKENS = 32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gpt_oss"))
    hf_model = make_tiny_gpt_oss(directory)
    return hf_model, load_model(directory, torch.float32, CPU)


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3_moe"))
    hf_model = make_tiny_qwen3_moe(directory)
    return hf_model, load_model(directory, torch.float32, CPU)


class _SinkSpy:
    """Stands in for `ops()`: counts native decode-attention calls that carried sinks."""

    def __init__(self, inner):
        self.inner, self.calls_with_sinks, self.calls = inner, 0, 0

    def paged_decode_attention(self, *args):
        self.calls += 1
        self.calls_with_sinks += args[-1] is not None
        return self.inner.paged_decode_attention(*args)


@pytest.mark.parametrize("native_experts", [True, False])
def test_gpt_oss_window_shorter_than_prompt_matches_transformers_with_native_decode(gpt_oss, monkeypatch,
                                                                                   native_experts):
    """With the native experts, decode runs the fused stack (sinks and experts in C++); without
    them, the per-op step with the native attention kernel, every call carrying the sinks."""
    require_native_kernels()
    hf_model, loaded = gpt_oss
    spy = _SinkSpy(decode_attention.ops())
    monkeypatch.setattr(decode_attention, "ops", lambda: spy)
    experts = [layer.mlp.experts for layer in loaded.model.layers]
    for module in experts:
        monkeypatch.setattr(module, "native_enabled", native_experts)
    # 90-token prompts (> 5x the window of 16), block size 4, prefilled in chunks of at most 24
    # tokens while others decode.
    prompts = [random_prompt(n, GPT_OSS_VOCAB, seed) for seed, n in enumerate((7, 45, 90))]
    engine = make_engine(loaded=loaded, block_size=4, budget=24)
    fused = engine.runner.decode_step._fused
    assert engine.runner.decode_step.native and (fused is not None) == native_experts
    if fused is not None:
        assert all(layer.sinks is not None and layer.moe is not None for layer in fused)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)
    if not native_experts:
        assert spy.calls > 0 and spy.calls_with_sinks == spy.calls


def test_gpt_oss_gathered_decode_path_matches_transformers(gpt_oss, monkeypatch):
    """The path CUDA and bf16 take (one padded gather, SDPA with the sink column), run on the CPU."""
    hf_model, loaded = gpt_oss
    for module in (decode_step, paged_attention):
        monkeypatch.setattr(module, "uses_native_kernel", lambda device, dtype: False)
    prompts = [random_prompt(n, GPT_OSS_VOCAB, 20 + seed) for seed, n in enumerate((30, 70))]
    engine = make_engine(loaded=loaded, block_size=4, budget=24)
    assert not engine.runner.decode_step.native
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)


def test_qwen3_moe_batched_chunked_greedy_matches_transformers(qwen_moe):
    hf_model, loaded = qwen_moe
    prompts = [random_prompt(n, QWEN_MOE_VOCAB, seed) for seed, n in enumerate((7, 45, 90))]
    engine = make_engine(loaded=loaded, block_size=4, budget=32)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen_moe"])
def test_prefix_cache_hits_give_the_same_tokens(family, request):
    hf_model, loaded = request.getfixturevalue(family)
    vocab = GPT_OSS_VOCAB if family == "gpt_oss" else QWEN_MOE_VOCAB
    shared = random_prompt(48, vocab, 7)
    prompts = [shared + random_prompt(n, vocab, 8 + n) for n in (9, 14)]
    warm = make_engine(loaded=loaded, block_size=4)
    first = generate(warm, [prompts[0]], greedy(NUM_TOKENS, ignore_eos=True), prefix="first")[0]
    second = generate(warm, [prompts[1]], greedy(NUM_TOKENS, ignore_eos=True), prefix="second")[0]
    assert second.final.num_cached_tokens >= 40  # the shared prefix, whole blocks only
    for prompt, result in zip(prompts, (first, second)):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)


def test_gpt_oss_gets_one_full_and_one_window_group_and_releases_out_of_window_blocks(gpt_oss):
    _, loaded = gpt_oss
    engine = make_engine(loaded=loaded, block_size=4, budget=16)
    specs = [group.spec for group in engine.plan.groups]
    assert specs == [FullAttentionSpec(), SlidingWindowSpec(GPT_OSS_WINDOW)]
    loop = engine.engine.engine_loop
    loop.submit(GenerationRequest("long", tuple(random_prompt(200, GPT_OSS_VOCAB, 99)), greedy(8, ignore_eos=True)),
                lambda output: None)
    loop._drain_inbox(block=False)
    held = []
    while loop.scheduler.has_work():
        loop.step()
        if loop.scheduler.requests.get("long") is not None:
            held.append([engine.kv_manager.num_blocks_held("long", g.group_id) for g in engine.plan.groups])
    window_blocks = -(-GPT_OSS_WINDOW // 4) + 1
    assert held[-1][0] == -(-207 // 4)
    assert all(counts[1] <= window_blocks + 16 // 4 for counts in held)
    assert held[-1][1] <= window_blocks
    engine.kv_manager.check_invariants()


def test_gpt_oss_batched_sequential_and_preempted_runs_agree(gpt_oss):
    _, loaded = gpt_oss
    prompts = [random_prompt(n, GPT_OSS_VOCAB, 10 + n) for n in (30, 64, 100)]
    sampling = greedy(NUM_TOKENS, ignore_eos=True)
    sequential = generate_one_by_one(make_engine(loaded=loaded, block_size=4, prefix_caching=False), prompts, sampling)
    tiny = make_engine(loaded=loaded, block_size=4, num_blocks=50, prefix_caching=False)
    preempted = generate(tiny, prompts, sampling)
    assert tiny.engine.engine_loop.stats.metrics.scheduler.preemptions._value.get() > 0
    assert [r.token_ids for r in preempted] == [r.token_ids for r in sequential]
