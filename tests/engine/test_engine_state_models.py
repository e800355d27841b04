"""Hybrid models with recurrent state (tiny random Qwen3.5: Gated DeltaNet + full attention, and
Nemotron-H: Mamba2 + attention + MLP blocks) on the real engine: paged pool with state groups,
scheduler, chunked prefill, batching and preemption, prefix caching through state snapshots,
greedy, token for token against transformers."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.specs import RecurrentStateSpec
from pdserve.models.loader import load_model
from tests.engine.harness import engine_with_tier, generate, generate_one_by_one, greedy, make_engine, two_passes
from tests.models.hf_oracle import hf_greedy_generate
from tests import tiny_models
from tests.devices import cuda_available
from tests.tiny_models import random_prompt

NUM_TOKENS = 16
BLOCK = 4
FAMILIES = ("qwen3_5", "nemotron_h")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    hf_model = getattr(tiny_models, f"make_tiny_{request.param}")(directory)
    return hf_model, load_model(directory, torch.float32, torch.device("cpu")), directory


def _vocab(hf_model) -> int:
    return hf_model.config.vocab_size


def test_batched_chunked_prompts_match_transformers(family):
    hf_model, loaded, _ = family
    assert loaded.model.spec.has_recurrent_state
    # Prompts longer than a prefill chunk (budget 24), batched with each other and with decodes.
    prompts = [random_prompt(n, _vocab(hf_model), seed) for seed, n in enumerate((9, 50, 83))]
    engine = make_engine(loaded=loaded, block_size=BLOCK, budget=24)
    results = generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)



@pytest.mark.parametrize("interval", [0, 2])
def test_one_long_prefill_chunk_still_leaves_the_periodic_snapshots(family, interval):
    """With a budget larger than the prompt, the chunk ends at every `--state-snapshot-interval` boundary
    (the state exists only where a step ended), so a prompt diverging mid-way restores the latest one."""
    hf_model, loaded, _ = family
    engine = make_engine(loaded=loaded, block_size=BLOCK, budget=512, snapshot_interval=interval)
    vocab = _vocab(hf_model)
    shared = random_prompt(37, vocab, 40)
    sampling = greedy(4, ignore_eos=True)
    generate(engine, [shared + random_prompt(20, vocab, 41)], sampling, prefix="long")
    [result] = generate(engine, [shared + random_prompt(6, vocab, 42)], sampling, prefix="diverging")
    assert result.token_ids == hf_greedy_generate(hf_model, shared + random_prompt(6, vocab, 42), 4)
    # KV alone would allow 36 (9 blocks); snapshots every 2 blocks of 4 tokens leave one at 32. Without
    # periodic ones the only snapshot is at the first prompt's last full block (56): nothing to restore.
    assert result.final.num_cached_tokens == (32 if interval == 2 else 0)

def test_preempted_and_resumed_requests_give_the_tokens_of_one_alone(family):
    hf_model, loaded, _ = family
    prompts = [random_prompt(n, _vocab(hf_model), 20 + n) for n in (30, 45, 60)]
    sampling = greedy(NUM_TOKENS, ignore_eos=True)
    alone = generate_one_by_one(make_engine(loaded=loaded, block_size=BLOCK, prefix_caching=False), prompts, sampling)
    tiny = make_engine(loaded=loaded, block_size=BLOCK, num_blocks=52, prefix_caching=False)
    preempted = generate(tiny, prompts, sampling)
    assert tiny.engine.engine_loop.stats.metrics.scheduler.preemptions._value.get() > 0
    assert [r.token_ids for r in preempted] == [r.token_ids for r in alone]


def test_a_shared_prefix_recomputes_only_the_tokens_after_the_latest_snapshot(family):
    hf_model, loaded, _ = family
    engine = make_engine(loaded=loaded, block_size=BLOCK, budget=16)
    vocab = _vocab(hf_model)
    shared = random_prompt(44, vocab, 7)
    sampling = greedy(NUM_TOKENS, ignore_eos=True)
    # The first prompt (47 tokens) runs in chunks ending at 16, 32 and 44 (its last full block): a
    # snapshot at each.
    generate(engine, [shared + random_prompt(3, vocab, 8)], sampling, prefix="first")
    stats = engine.engine.engine_loop.stats

    def run(prompt, name):
        computed_before = stats.num_computed_prompt_tokens
        [result] = generate(engine, [prompt], sampling, prefix=name)
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)
        assert stats.num_computed_prompt_tokens - computed_before == len(prompt) - result.final.num_cached_tokens
        return result.final.num_cached_tokens

    # A next turn sharing all 44 tokens restores the snapshot at 44 and computes only its own 9.
    assert run(shared + random_prompt(9, vocab, 9), "turn") == 44
    # A prompt sharing 42 tokens hits 10 blocks (40 tokens) of attention KV, but the state is known only
    # at snapshots: the latest at or before 40 (32 from the chunk ends, 40 if a decode-time interval
    # snapshot landed there), and everything after it is computed.
    assert run(shared[:42] + random_prompt(11, vocab, 10), "diverging") in (32, 36, 40)


def test_state_groups_hold_one_live_page_per_request_and_free_it_at_the_end(family):
    _, loaded, _ = family
    engine = make_engine(loaded=loaded, block_size=BLOCK, prefix_caching=False)
    plan = engine.plan
    state_groups = [g.group_id for g in plan.groups if isinstance(g.spec, RecurrentStateSpec)]
    assert state_groups
    loop = engine.engine.engine_loop
    from pdserve.request import GenerationRequest

    loop.submit(GenerationRequest("one", tuple(random_prompt(30, 200, 1)), greedy(4, ignore_eos=True)), lambda o: None)
    loop._drain_inbox(block=False)
    held = []
    while loop.scheduler.has_work():
        loop.step()
        if loop.scheduler.requests.get("one") is not None:
            held.append([engine.kv_manager.num_blocks_held("one", g) for g in state_groups])
            # What /metrics' pdserve_kv_usage_ratio{group} and the GIE usage gauge are computed from.
            in_use = engine.kv_manager.num_blocks_in_use_by_group()
            assert all(in_use[g] >= 1 for g in state_groups)
    assert held and all(counts == [1] * len(state_groups) for counts in held)
    assert engine.kv_manager.num_blocks_in_use_by_group() == (0,) * len(plan.groups)


def test_with_the_offload_tier_a_second_pass_over_more_prompts_than_the_pool_holds_recomputes_little(family):
    """Ten 40-token prompts through a pool that holds about four: their attention blocks and state
    snapshots go to the tier on eviction and come back on the second pass, with the same answers."""
    hf_model, loaded, _ = family
    prompts = [random_prompt(40, _vocab(hf_model), 300 + seed) for seed in range(10)]
    total = sum(len(p) for p in prompts)
    plain = engine_with_tier(loaded, num_blocks=61, offload_bytes=None)
    first_plain, second_plain, recomputed_plain = two_passes(plain, prompts)
    tiered = engine_with_tier(loaded, num_blocks=61, offload_bytes=400 * plain.layout.page_bytes)
    first_tier, second_tier, recomputed_tier = two_passes(tiered, prompts)
    assert recomputed_plain >= 0.9 * total
    assert recomputed_tier <= 0.25 * total
    assert first_tier == second_tier == first_plain == second_plain
    assert first_plain[0] == hf_greedy_generate(hf_model, prompts[0], 8)
    metrics = tiered.engine.engine_loop.stats.metrics
    assert metrics.kv.prefix_cache_hits_by_medium_tokens.labels("offload")._value.get() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_on_cuda_batched_chunked_prompts_and_a_snapshot_hit_match_transformers(family):
    """The paged state path (page gathers and scatters, page copies) on the GPU, float32."""
    import copy

    hf_cpu, _, directory = family
    hf_model = copy.deepcopy(hf_cpu).to("cuda")
    loaded = load_model(directory, torch.float32, torch.device("cuda"))
    engine = make_engine(loaded=loaded, block_size=BLOCK, budget=16, device="cuda")
    vocab = _vocab(hf_model)
    prompts = [random_prompt(n, vocab, 40 + n) for n in (9, 50, 83)]
    for prompt, result in zip(prompts, generate(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))):
        assert result.token_ids == hf_greedy_generate(hf_model, prompt, NUM_TOKENS)
    shared = random_prompt(44, vocab, 7)
    generate(engine, [shared + random_prompt(3, vocab, 8)], greedy(4, ignore_eos=True), prefix="first")
    turn = shared + random_prompt(9, vocab, 9)
    [result] = generate(engine, [turn], greedy(NUM_TOKENS, ignore_eos=True), prefix="turn")
    assert result.final.num_cached_tokens == 44
    assert result.token_ids == hf_greedy_generate(hf_model, turn, NUM_TOKENS)


def test_lost_snapshots_in_a_torn_file_tier_mean_recomputing_never_wrong_tokens(family, tmp_path):
    """State snapshots whose tier pages were damaged fail their loads: the request recomputes from the
    start (a snapshot that cannot be read is never restored), with the same answers."""
    hf_model, loaded, _ = family
    prompts = [random_prompt(40, _vocab(hf_model), 500 + seed) for seed in range(10)]
    built = engine_with_tier(loaded, num_blocks=61, offload_bytes=64 << 20, offload_dir=str(tmp_path))
    sampling = greedy(8, ignore_eos=True)
    first = generate_one_by_one(built, prompts, sampling)
    pages = tmp_path / "pages.bin"
    pages.write_bytes(b"\x5a" * pages.stat().st_size)  # every stored page torn
    second = generate_one_by_one(built, prompts, sampling)
    tier = built.kv_manager.offload
    assert tier.stats.num_failed_loads >= 3
    assert [r.token_ids for r in second] == [r.token_ids for r in first]
    built.kv_manager.check_invariants()
    tier.check_invariants()
