"""The engine (paged pool, scheduler, chunked prefill) on tiny random Qwen3 and
Gemma 3 checkpoints, greedy, token for token against transformers."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.specs import FullAttentionSpec
from pdserve.models.loader import load_model
from tests.engine.harness import generate, generate_one_by_one, greedy, make_engine
from tests.models.hf_oracle import hf_greedy_generate
from tests.tiny_models import GEMMA_VOCAB, GEMMA_WINDOW, QWEN_VOCAB, make_tiny_gemma3, make_tiny_qwen3, random_prompt

NUM_TOKENS = 40


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3"))
    hf_model = make_tiny_gemma3(directory)
    return hf_model, load_model(directory, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    hf_model = make_tiny_qwen3(directory)
    return hf_model, load_model(directory, torch.float32, torch.device("cpu"))


def test_qwen3_batched_chunked_greedy_matches_transformers(qwen):
    hf_model, loaded = qwen
    prompts = [random_prompt(n, QWEN_VOCAB, seed) for seed, n in enumerate((7, 45, 90))]
    engine = make_engine(loaded=loaded, block_size=4, budget=32)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)


def test_gemma3_with_window_shorter_than_prompt_matches_transformers(gemma):
    hf_model, loaded = gemma
    # 100-token prompts (> 6x the window of 16), block size 4 (25 blocks),
    # prefilled in chunks of at most 24 tokens while others decode.
    prompts = [random_prompt(100, GEMMA_VOCAB, seed) for seed in range(3)]
    engine = make_engine(loaded=loaded, block_size=4, budget=24)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)


def test_gemma3_batched_sequential_and_preempted_runs_agree(gemma):
    _, loaded = gemma
    prompts = [random_prompt(n, GEMMA_VOCAB, 10 + n) for n in (30, 64, 100)]
    sampling = greedy(NUM_TOKENS, ignore_eos=True)
    sequential = generate_one_by_one(make_engine(loaded=loaded, block_size=4, prefix_caching=False), prompts, sampling)
    batched = generate(make_engine(loaded=loaded, block_size=4, prefix_caching=False), prompts, sampling)
    tiny = make_engine(loaded=loaded, block_size=4, num_blocks=50, prefix_caching=False)
    preempted = generate(tiny, prompts, sampling)
    assert tiny.engine.engine_loop.stats.metrics.scheduler.preemptions._value.get() > 0
    assert [r.token_ids for r in batched] == [r.token_ids for r in sequential] == [r.token_ids for r in preempted]


def test_gemma3_sliding_groups_hold_only_the_window_during_a_long_request(gemma):
    _, loaded = gemma
    engine = make_engine(loaded=loaded, block_size=4, budget=16)
    loop = engine.engine.engine_loop
    from pdserve.request import GenerationRequest

    loop.submit(GenerationRequest("long", tuple(random_prompt(200, GEMMA_VOCAB, 99)), greedy(8, ignore_eos=True)), lambda o: None)
    loop._drain_inbox(block=False)
    held = []
    while loop.scheduler.has_work():
        loop.step()
        request = loop.scheduler.requests.get("long")
        if request is not None:
            held.append([engine.kv_manager.num_blocks_held("long", g.group_id) for g in engine.plan.groups])
    full_ids = [g.group_id for g in engine.plan.groups if isinstance(g.spec, FullAttentionSpec)]
    sliding_ids = [g.group_id for g in engine.plan.groups if g.group_id not in full_ids]
    last = held[-1]
    window_blocks = -(-GEMMA_WINDOW // 4) + 1
    assert all(last[g] == -(-207 // 4) for g in full_ids)
    assert all(counts[g] <= window_blocks + 16 // 4 for counts in held for g in sliding_ids)
    assert all(last[g] <= window_blocks for g in sliding_ids)


@pytest.mark.parametrize("kv_cache_dtype, page_bytes", [("float32", 8192), ("bfloat16", 4096)])
def test_pool_sized_from_a_memory_budget(qwen, kv_cache_dtype, page_bytes):
    from pdserve.api.config import CacheConfig, ModelConfig, WorkerConfig
    from pdserve.app.engine_factory import build_engine
    from pdserve.metrics import Metrics

    _, loaded = qwen
    config = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=4, kv_memory_bytes=1 << 20, kv_cache_dtype=kv_cache_dtype))
    built = build_engine(config, Metrics(), loaded)
    # Qwen3 tiny: 4 layers in one group, 2 KV heads of 32 dims -> 4*2*4*2*32 elements a page: 8 KiB in
    # float32, 4 KiB in bfloat16 (twice the blocks in the same budget).
    assert built.layout.page_bytes == page_bytes
    assert built.layout.num_blocks == (1 << 20) // page_bytes
    assert built.runner.pool.numel() * built.runner.pool.element_size() <= 1 << 20
