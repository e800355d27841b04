"""The batched sampler: right distribution, seeded rows independent of their batch and
of preemption, one transfer to the host per step (and, on CUDA, no other synchronisation)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.runner.sampler import Sampler
from pdserve.engine.schedule_types import ScheduledChunk
from tests.devices import cuda_available
from tests.models.test_quantized_blocks import require_native_kernels

VOCAB = 50


def chunk(request_id: str, num_sampled: int = 0, **params) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 0, ([1],), sample=True, sampling=SamplingParams(**params),
                          num_sampled_so_far=num_sampled)


def random_logits(num_rows: int, seed: int, device: str) -> torch.Tensor:
    return (torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def test_greedy_rows_take_the_argmax_and_logprobs_are_the_unscaled_log_softmax(device):
    logits = random_logits(4, 0, device)
    chunks = [chunk("g1", temperature=0), chunk("r1", temperature=0.7, seed=3, logprobs=True),
              chunk("g2", temperature=0, logprobs=True), chunk("r2", temperature=1.3, top_k=5)]
    sampled = Sampler(torch.device(device)).sample(logits, chunks)
    assert [s.request_id for s in sampled] == ["g1", "r1", "g2", "r2"]
    assert sampled[0].token_id == logits[0].argmax().item()
    assert sampled[2].token_id == logits[2].argmax().item()
    log_probs = logits.double().log_softmax(-1).cpu()
    for row in (1, 2):
        assert sampled[row].logprob == pytest.approx(log_probs[row, sampled[row].token_id].item(), abs=1e-5)
    assert sampled[0].logprob == 0.0 and sampled[3].logprob == 0.0  # not asked for


@pytest.mark.parametrize("params", [
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.5, top_p=0.6),
    dict(temperature=0.9, top_k=6, top_p=0.8),
], ids=["temperature", "top-k", "top-p", "top-k-top-p"])
def test_sampled_frequencies_follow_the_filtered_distribution(device, params):
    num_rows = 20_000
    row = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0])
    logits = row.expand(num_rows, -1).contiguous().to(device)
    sampler = Sampler(torch.device(device), seed=11)
    tokens = [s.token_id for s in sampler.sample(logits, [chunk(f"r{i}", **params) for i in range(num_rows)])]
    expected = _expected_probs(row, **params)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(row)).double() / num_rows
    for token, (frequency, probability) in enumerate(zip(counts.tolist(), expected.tolist())):
        if probability == 0:
            assert frequency == 0, f"token {token} is outside top-k/top-p but was sampled"
        else:  # 5 standard deviations of a binomial frequency
            assert abs(frequency - probability) < 5 * math.sqrt(probability * (1 - probability) / num_rows) + 1e-9


def _expected_probs(row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target distribution, computed the slow obvious way (row is sorted descending)."""
    probs = (row.double() / temperature).softmax(-1)
    keep = len(row) if top_k == 0 else top_k
    probs[keep:] = 0
    probs /= probs.sum()
    kept, mass = 0, 0.0
    while kept < keep and (kept == 0 or mass < top_p):
        mass += probs[kept].item()
        kept += 1
    probs[kept:] = 0
    return probs / probs.sum()


def _seeded_run(sampler: Sampler, request_id: str, steps: range, neighbours: int, device: str) -> list[int]:
    """Tokens of one seeded request over `steps`, sharing each step with `neighbours` other rows."""
    tokens = []
    for step in steps:
        own = random_logits(1, 100 + step, device)  # its logits depend on the step only
        neighbour_logits = random_logits(neighbours, 500 + step, device)
        others = [chunk(f"n{step}-{i}", temperature=1.0 + 0.1 * i, seed=i if i % 2 else None, top_p=0.9)
                  for i in range(neighbours)]
        half = neighbours // 2
        chunks = [*others[:half], chunk(request_id, step, temperature=1.0, top_k=20, seed=1234), *others[half:]]
        logits = torch.cat([neighbour_logits[:half], own, neighbour_logits[half:]])
        tokens.append(sampler.sample(logits, chunks)[half].token_id)
    return tokens


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(device):
    alone = _seeded_run(Sampler(torch.device(device), seed=1), "s", range(12), 0, device)
    crowded = _seeded_run(Sampler(torch.device(device), seed=2), "s", range(12), 7, device)
    assert alone == crowded
    assert len(set(alone)) > 1  # really random, not a fixed token


def test_a_seeded_request_resumes_identically_after_preemption_or_on_another_worker(device):
    uninterrupted = _seeded_run(Sampler(torch.device(device)), "s", range(10), 3, device)
    sampler = Sampler(torch.device(device))
    # Preempted before its first token: recomputed from scratch, the first draw repeats.
    _seeded_run(sampler, "s", range(0, 1), 3, device)
    resumed = _seeded_run(sampler, "s", range(0, 6), 3, device)
    # Preempted after 6 tokens: its generator carries on from draw 6.
    resumed += _seeded_run(sampler, "s", range(6, 10), 3, device)
    assert resumed == uninterrupted
    # A worker that never saw its first 4 draws (e.g. a decode worker) lands on the same draws.
    assert _seeded_run(Sampler(torch.device(device)), "s", range(4, 10), 2, device) == uninterrupted[4:]


def test_a_late_draw_costs_what_the_first_does_and_each_draw_has_its_own_seed():
    from pdserve.runner.sampler import draw_seed

    sampler = Sampler(torch.device("cpu"))
    late = chunk("s", 1_000_000_000, temperature=1.0, seed=7)  # a billion earlier draws, none replayed
    assert sampler.batch([late], VOCAB).seeded[0][1] == draw_seed(7, 1_000_000_000)
    seeds = {draw_seed(seed, index) for seed in (0, 1, -2**63, 2**64 - 1) for index in range(1000)}
    assert len(seeds) == 4000 and all(0 <= s < 2**63 for s in seeds)


def test_one_transfer_to_the_host_per_step_whatever_the_batch(device, monkeypatch):
    transfers = []
    for method in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _name=method, **kwargs):
            transfers.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    sampler = Sampler(torch.device(device))
    chunks = [chunk(f"r{i}", temperature=0.5 + i % 3, top_k=i % 4 * 3, top_p=1 - 0.1 * (i % 5),
                    seed=i if i % 2 else None, logprobs=i % 3 == 0) for i in range(16)]
    chunks[5] = chunk("greedy", temperature=0)
    for step in range(3):
        sampler.sample(random_logits(16, step, device), chunks)
    assert transfers == ["tolist"] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_sampling_on_cuda_never_waits_for_the_device():
    sampler = Sampler(torch.device("cuda"))
    chunks = [chunk(f"r{i}", temperature=0.7, top_k=10, top_p=0.9, seed=i if i % 2 else None, logprobs=True)
              for i in range(8)] + [chunk("greedy", temperature=0)]
    logits = random_logits(9, 0, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids, logprobs, _ = sampler.sample_on_device(logits, chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert token_ids.shape == (9,) and logprobs.shape == (9,)


def test_native_greedy_choice_equals_the_torch_path_ties_and_broken_rows_included():
    """Plain greedy steps on the CPU take one native call: the same ids (the first of tied
    maxima), and the same rows failed (a NaN, +inf or -inf anywhere, or nothing but -inf)."""
    require_native_kernels()
    vocab = 49_157  # not a multiple of the kernel's 8 lanes
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(4)) * 5
    logits[1, [17, 40_000]] = 100.0  # a tie: the first index wins
    logits[2, -1] = 100.0  # the maximum in the scalar tail
    logits[3, 123] = float("nan")
    logits[4, vocab - 2] = float("inf")
    logits[5, 7] = float("-inf")
    logits[6] = float("-inf")
    logits[7] = -3.0  # all equal
    chunks = [chunk(f"g{row}", temperature=0) for row in range(8)]
    native = Sampler(torch.device("cpu"), native_greedy=True)
    reference = Sampler(torch.device("cpu"), native_greedy=False)
    assert native.native_greedy and not reference.native_greedy
    fast, slow = native.sample(logits, chunks), reference.sample(logits, chunks)
    assert [(s.token_id, s.failed) for s in fast] == [(s.token_id, s.failed) for s in slow]
    assert [s.token_id for s in fast[:3]] == [int(logits[0].argmax()), 17, vocab - 1]
    assert [s.failed for s in fast] == [False, False, False, True, True, True, True, False]
    assert fast[7].token_id == 0
    # Anything beyond plain greedy (here logprobs) still takes the torch path, with its extras.
    with_logprobs = native.sample(logits[:1], [chunk("l", temperature=0, logprobs=True)])
    assert with_logprobs[0].logprob == pytest.approx(logits[0].double().log_softmax(-1).max().item(), abs=1e-5)
