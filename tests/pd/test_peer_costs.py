"""The peer-pull decision from this worker's own measurements: computing N prompt tokens is priced by
its prefill steps, pulling them by its pin round trips and landed pulls; it pulls only when the pull is
predicted faster (or to probe a price that said no), never under the floor, and `threshold` keeps the
floor alone."""

from __future__ import annotations

import pytest

from pdserve.pd.peer_costs import MIN_MEASURED_PREFILL_TOKENS, PeerPullCosts


def test_the_seeds_pull_long_prefixes_and_compute_short_ones():
    costs = PeerPullCosts(min_tokens=16)
    crossover = costs.crossover_tokens
    assert crossover is not None and 16 < crossover < 1000
    assert costs.verdict(int(crossover) + 1).pull
    short = costs.verdict(int(crossover) - 1)
    assert not short.pull and short.result == "costlier" and "predicted pull" in short.reason


def test_the_floor_holds_whatever_the_prices():
    costs = PeerPullCosts(min_tokens=64, compute_s_per_token=1.0, pull_s_per_token=0.0, pin_s=0.0)
    verdict = costs.verdict(63)
    assert not verdict.pull and verdict.result == "skipped" and "--peer-pull-min-tokens" in verdict.reason
    assert costs.verdict(64).pull


def test_threshold_follows_every_hint_at_or_above_the_floor():
    costs = PeerPullCosts(min_tokens=64, measured=False, compute_s_per_token=0.0, pull_s_per_token=1.0)
    assert costs.verdict(64).pull and not costs.verdict(63).pull


def test_measured_prefill_steps_and_pulls_move_the_crossover():
    costs = PeerPullCosts(min_tokens=1, weight=0.5, compute_s_per_token=1e-4, pull_s_per_token=2e-5, pin_s=5e-3)
    assert costs.verdict(100).pull is True  # seeds: 7 ms pull against 10 ms compute
    for _ in range(20):  # a fast prefill (a small model on a big GPU): 10 us a token
        costs.observe_prefill(512, 512 * 1e-5)
    assert costs.compute_s_per_token == pytest.approx(1e-5, rel=1e-3)
    assert costs.crossover_tokens is None  # a READ (20 us a token) no longer beats computing at any length
    assert not costs.verdict(100_000).pull
    for _ in range(20):  # landed pulls at 1 us a token, pins of 1 ms
        costs.observe_pull(1000, 1000 * 1e-6)
        costs.observe_pin(1e-3)
    assert costs.crossover_tokens == pytest.approx(1e-3 / (1e-5 - 1e-6), rel=1e-3)  # about 111 tokens
    assert not costs.verdict(100).pull and costs.verdict(120).pull
    assert costs.num_prefill_observations == 20 and costs.num_pull_observations == 20


def test_every_probe_every_th_costlier_hint_is_pulled_to_measure_again():
    costs = PeerPullCosts(min_tokens=1, weight=1.0, compute_s_per_token=1e-5, pull_s_per_token=1e-4, pin_s=0.0,
                          probe_every=4)
    verdicts = [costs.verdict(100) for _ in range(8)]
    assert [v.pull for v in verdicts] == [False, False, False, True] * 2
    assert "measure again" in verdicts[3].reason and verdicts[0].result == "costlier"
    costs.observe_pull(100, 100 * 1e-6)  # the probe landed fast: the price comes back down
    assert costs.verdict(100).pull and costs.describe(100) == costs.describe(100)


def test_small_steps_and_empty_observations_do_not_price_anything():
    costs = PeerPullCosts()
    before = (costs.compute_s_per_token, costs.pull_s_per_token, costs.pin_s)
    costs.observe_prefill(MIN_MEASURED_PREFILL_TOKENS - 1, 1.0)  # a decode-heavy step: mostly fixed cost
    costs.observe_prefill(512, 0.0)
    costs.observe_pull(0, 1.0)
    costs.observe_pin(0.0)
    assert (costs.compute_s_per_token, costs.pull_s_per_token, costs.pin_s) == before
    assert costs.num_prefill_observations == costs.num_pull_observations == 0


def test_a_weight_outside_zero_to_one_or_no_probe_is_refused():
    with pytest.raises(ValueError):
        PeerPullCosts(weight=0.0)
    with pytest.raises(ValueError):
        PeerPullCosts(probe_every=0)
