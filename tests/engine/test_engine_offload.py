"""The offload tier on real engines (tiny random checkpoints, CPU): prompts evicted from a small pool
come back from host memory instead of being recomputed, with the same greedy tokens, and a sliding-
window model reloads only the blocks inside its window."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.kv.prefix import first_live_block, max_hit_blocks
from pdserve.models.loader import load_model
from tests.engine.harness import engine_with_tier, generate_one_by_one, greedy, two_passes
from tests.tiny_models import GEMMA_VOCAB, QWEN_VOCAB, make_tiny_gemma3, make_tiny_qwen3, random_prompt

BLOCK = 4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_gemma3(directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


def test_prompts_evicted_from_the_pool_come_back_from_the_tier_with_the_same_tokens(qwen):
    # 10 prompts of 40 tokens (10 blocks each): 100 blocks through a pool of 40.
    prompts = [random_prompt(40, QWEN_VOCAB, 200 + seed) for seed in range(10)]
    total = sum(len(p) for p in prompts)
    plain = engine_with_tier(qwen, num_blocks=41, offload_bytes=None)
    first_plain, second_plain, recomputed_plain = two_passes(plain, prompts)
    page_bytes = plain.layout.page_bytes
    tiered = engine_with_tier(qwen, num_blocks=41, offload_bytes=200 * page_bytes)
    first_tier, second_tier, recomputed_tier = two_passes(tiered, prompts)
    print(f"second pass recomputed {recomputed_plain}/{total} without a tier, {recomputed_tier}/{total} with one")
    assert recomputed_plain >= 0.9 * total
    assert recomputed_tier <= 0.25 * total
    assert first_tier == second_tier == first_plain == second_plain
    metrics = tiered.engine.engine_loop.stats.metrics
    assert metrics.offload.bytes.labels("load")._value.get() > 0
    assert metrics.kv.prefix_cache_hits_by_medium_tokens.labels("offload")._value.get() > 0
    assert plain.kv_manager.offload is None


def test_the_file_tier_really_writes_files_on_its_io_thread_and_serves_the_second_pass(qwen, tmp_path, monkeypatch):
    prompts = [random_prompt(40, QWEN_VOCAB, 200 + seed) for seed in range(10)]
    total = sum(len(p) for p in prompts)
    plain_first, _, _ = two_passes(engine_with_tier(qwen, num_blocks=41, offload_bytes=None), prompts)
    writers = set()
    real_pwrite = os.pwrite

    def recording_pwrite(fd, data, offset):
        writers.add(threading.current_thread().name)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    built = engine_with_tier(qwen, num_blocks=41, offload_bytes=64 << 20, offload_dir=str(tmp_path))
    first, second, recomputed = two_passes(built, prompts)
    print(f"file tier: second pass recomputed {recomputed}/{total}")
    assert recomputed <= 0.25 * total
    assert first == second == plain_first
    assert (tmp_path / "pages.bin").stat().st_size > 0
    assert built.kv_manager.offload.store.medium == "disk"
    assert writers and all(name.startswith("pdserve-kv-offload") for name in writers)  # never the engine thread
    skipped = built.engine.engine_loop.stats.metrics.offload.skipped_stores
    assert skipped.labels("failed")._value.get() == 0


def test_a_corrupted_file_tier_means_recomputing_never_wrong_tokens(qwen, tmp_path):
    prompts = [random_prompt(40, QWEN_VOCAB, 400 + seed) for seed in range(10)]
    built = engine_with_tier(qwen, num_blocks=41, offload_bytes=64 << 20, offload_dir=str(tmp_path))
    sampling = greedy(8, ignore_eos=True)
    first = generate_one_by_one(built, prompts, sampling)
    pages = tmp_path / "pages.bin"
    pages.write_bytes(b"\x5a" * pages.stat().st_size)  # every page torn
    tier = built.kv_manager.offload
    second = generate_one_by_one(built, prompts, sampling)
    # Prompts whose pages were written before the damage fail their loads and recompute; the
    # last few were still on the device then, are stored afresh during this pass and load fine.
    assert tier.stats.num_failed_loads >= 5
    assert [r.token_ids for r in second] == [r.token_ids for r in first]
    built.kv_manager.check_invariants()
    tier.check_invariants()


def test_gemma3_reloads_only_the_blocks_inside_the_window(gemma):
    prompt = random_prompt(100, GEMMA_VOCAB, 7)
    others = [random_prompt(100, GEMMA_VOCAB, 100 + seed) for seed in range(3)]
    built = engine_with_tier(gemma, num_blocks=80, offload_bytes=1 << 30)
    sampling = greedy(8, ignore_eos=True)
    expected = generate_one_by_one(engine_with_tier(gemma, num_blocks=400, offload_bytes=None), [prompt], sampling)
    generate_one_by_one(built, [prompt, *others], sampling)  # the others push every page of `prompt` out
    tier = built.kv_manager.offload
    loaded_before = tier.stats.num_load_bytes
    again = generate_one_by_one(built, [prompt], sampling)
    num_hit = max_hit_blocks(len(prompt), BLOCK)
    pages = sum(num_hit - first_live_block(group, num_hit * BLOCK, BLOCK) for group in built.plan.groups)
    sliding = [g for g in built.plan.groups if first_live_block(g, num_hit * BLOCK, BLOCK) > 0]
    assert sliding, "the window must be shorter than the prompt"
    assert tier.stats.num_load_bytes - loaded_before == pages * built.layout.page_bytes
    assert again[0].token_ids == expected[0].token_ids


def test_a_tier_load_wakes_the_engine_thread_rather_than_waiting_out_its_poll_interval(qwen, tmp_path, monkeypatch):
    """The engine thread, idle but for a request whose prefix is read from the file tier, waits on its
    inbox for the poll interval; the read's end wakes it. Forced order: the read starts only once the
    engine has polled and found it still running, and the interval is made a minute long, so without
    the wake-up the request would wait the minute."""
    from pdserve.engine import loop as loop_module
    from pdserve.request import GenerationRequest

    prompts = [random_prompt(40, QWEN_VOCAB, 300 + seed) for seed in range(10)]
    probe = engine_with_tier(qwen, num_blocks=41, offload_bytes=None)
    built = engine_with_tier(qwen, num_blocks=41, offload_bytes=200 * probe.layout.page_bytes,
                             offload_dir=str(tmp_path))
    sampling = greedy(8, ignore_eos=True)
    first = generate_one_by_one(built, prompts, sampling)  # on this thread: fills the pool, then the tier
    tier = built.kv_manager.offload
    loads_before = tier.stats.num_loads
    polled_while_reading = threading.Event()
    start_tier_read, poll, read = tier.start_tier_read, tier.poll, tier.store.read
    load_ids = []

    def start_and_note(load_id, loads):  # noqa: ANN001
        load_ids.append(load_id)
        start_tier_read(load_id, loads)

    def poll_and_note():
        results = poll()
        if load_ids and tier.is_loading(load_ids[-1]):
            polled_while_reading.set()
        return results

    def read_after_a_poll(slots, block_ids):  # noqa: ANN001
        assert polled_while_reading.wait(30)
        read(slots, block_ids)

    monkeypatch.setattr(tier, "start_tier_read", start_and_note)
    monkeypatch.setattr(tier, "poll", poll_and_note)
    monkeypatch.setattr(tier.store, "read", read_after_a_poll)
    monkeypatch.setattr(loop_module, "POLL_WAIT_S", 60.0)
    loop = built.engine.engine_loop
    outputs, finished = [], threading.Event()

    def sink(output):  # noqa: ANN001
        outputs.append(output)
        if output.finished:
            finished.set()

    loop.start()
    try:
        loop.submit(GenerationRequest("again", tuple(prompts[0]), sampling), sink)
        assert finished.wait(30), "the engine thread slept through the tier read's end"
    finally:
        loop.shutdown()
        built.close()
    assert polled_while_reading.is_set()
    assert [t for output in outputs for t in output.new_token_ids] == first[0].token_ids
    assert tier.stats.num_loads > loads_before  # its prefix did come from the tier
