"""The adaptive disaggregation decision on recorded signals, and the prefill speed it learns."""

from __future__ import annotations

import pytest

from proxy.routing.disaggregation import DECODE, PREFILL, ArrivalRate, PrefillSpeed, Signals, Slo, decide

SLO = Slo(ttft_ms=1000, ttft_ms_per_token=2, tpot_ms=20)
MS_PER_TOKEN = 0.002  # 500 prompt tokens a second on either role (the 2-core VM: about this, one core each)


def signals(prompt: int, cached: int = 0, prefill_backlog: int = 0, decode_backlog: int = 0,
            running: int = 4, arrivals_per_s: float = 0.0) -> Signals:
    return Signals(prompt, cached, prefill_backlog, decode_backlog, running, arrivals_per_s)


def where(sig: Signals, prefill_rate=MS_PER_TOKEN, decode_rate=MS_PER_TOKEN, static_min: int = 0,
          stall_tpots: float = 10.0):
    decision = decide(sig, SLO, prefill_rate, decode_rate, static_min, stall_tpots)
    return decision.where, decision.reason


def test_before_any_measurement_the_static_threshold_decides():
    assert where(signals(100), prefill_rate=None, static_min=256) == (DECODE, "static_short")
    assert where(signals(300), prefill_rate=None, static_min=256) == (PREFILL, "static")
    assert where(signals(3), prefill_rate=None, static_min=0) == (PREFILL, "static")  # 0: always P/D
    assert where(signals(300, cached=200), prefill_rate=None, static_min=256) == (DECODE, "static_short")


def test_a_prompt_the_decode_worker_prefills_within_one_tpot_stays_there():
    assert where(signals(10)) == (DECODE, "short")  # 10 tokens: 20 ms, one TPOT
    assert where(signals(600, cached=592)) == (DECODE, "short")  # mostly cached on that decode worker
    assert where(signals(11))[0] == PREFILL  # 22 ms: a visible stall for the running streams


def test_a_long_prompt_goes_to_an_idle_prefill_worker():
    assert where(signals(1536)) == (PREFILL, "prefill_fits")  # 3.07 s against a budget of 4.07 s


def test_a_short_prompt_queued_behind_long_ones_moves_to_the_decode_worker():
    """Two 1,536-token prompts ahead on the prefill worker: a 100-token prompt would wait 6.3 s there
    (budget 1.2 s); the decode worker computes it in 0.2 s, a stall its streams absorb (<= 10 TPOTs)."""
    busy = signals(100, prefill_backlog=3072)
    assert where(busy) == (DECODE, "prefill_busy")
    assert where(signals(100, prefill_backlog=0)) == (PREFILL, "prefill_fits")  # and back once P is idle


def test_a_busy_decode_worker_does_not_take_a_prompt_that_would_stall_its_streams_too_long():
    """200 tokens behind the same queue: 0.4 s on the decode worker, more than its running streams may
    absorb (10 TPOTs, 0.2 s): they are protected and the prompt waits on P; with no stream running there
    the decode worker takes it."""
    assert where(signals(200, prefill_backlog=3072, running=4)) == (PREFILL, "best_effort")
    assert where(signals(200, prefill_backlog=3072, running=0)) == (DECODE, "prefill_busy")


def test_when_neither_fits_the_smaller_ttft_wins_only_on_an_idle_decode_worker():
    long_wait = signals(1536, prefill_backlog=6000, decode_backlog=3000, running=0)
    assert where(long_wait) == (DECODE, "best_effort")  # P: 15 s, D: 9 s, and D runs no stream
    assert where(signals(1536, prefill_backlog=6000, decode_backlog=3000, running=2)) == (PREFILL, "best_effort")
    decision = decide(long_wait, SLO, MS_PER_TOKEN, MS_PER_TOKEN, 0, 10.0)
    assert decision.ttft_prefill_s == pytest.approx(15.072) and decision.ttft_decode_s == pytest.approx(9.072)


def test_an_idle_decode_worker_takes_a_long_stall_only_while_no_request_is_expected_to_arrive_during_it():
    """The same prompts on an idle decode worker: 1,536 tokens stall it 3.1 s (4,536 with its backlog: 9
    s), 200 tokens 0.4 s. At 0.1 request/s the 3.1 s prompt expects 0.31 arrivals (taken, under 0.5);
    at 0.3/s, 0.92: the prompt waits on P, so streams and handoffs arriving meanwhile are not held."""
    assert where(signals(1536, prefill_backlog=6000, running=0, arrivals_per_s=0.1)) == (DECODE, "prefill_busy")
    assert where(signals(1536, prefill_backlog=6000, running=0, arrivals_per_s=0.3)) == (PREFILL, "best_effort")
    long_wait = signals(1536, prefill_backlog=6000, decode_backlog=3000, running=0, arrivals_per_s=0.3)
    assert where(long_wait) == (PREFILL, "best_effort")  # D's TTFT smaller, but not while it is expected busy
    assert where(signals(200, prefill_backlog=3072, running=0, arrivals_per_s=1.0)) == (DECODE, "prefill_busy")
    assert where(signals(200, prefill_backlog=3072, running=0, arrivals_per_s=1.5)) == (PREFILL, "best_effort")


def test_the_arrival_rate_counts_the_last_window_and_the_time_since_the_first_arrival_while_younger():
    now = [100.0]
    rate = ArrivalRate(clock=lambda: now[0], window_s=60.0)
    assert rate.per_s == 0.0
    rate.observe()
    rate.observe()
    assert rate.per_s == pytest.approx(2 / 60)  # under three seen: over the whole window, not a burst's span
    for _ in range(4):
        now[0] += 2.0
        rate.observe()
    assert rate.per_s == pytest.approx(6 / 30)  # six in 8 s: a start-up burst is read over at least 30 s
    for _ in range(12):
        now[0] += 2.0
        rate.observe()
    assert rate.per_s == pytest.approx(18 / 32)  # eighteen in the 32 s since the first
    now[0] += 100.0
    rate.observe()
    assert rate.per_s == pytest.approx(1 / 60)  # the old ones forgotten
    for _ in range(4):  # a burst after a quiet minute: over the window, not over the burst
        now[0] += 0.5
        rate.observe()
    assert rate.per_s == pytest.approx(5 / 60)


def test_the_decode_worker_rate_defaults_to_the_prefill_workers():
    assert where(signals(100, prefill_backlog=3072), decode_rate=None) == (DECODE, "prefill_busy")
    assert where(signals(100, prefill_backlog=3072), decode_rate=0.02)[0] == PREFILL  # a slow decode worker


def test_prefill_speed_is_measured_only_after_a_few_samples_and_follows_them():
    speed = PrefillSpeed()
    speed.observe(1000, 2.0)
    speed.observe(1000, 2.0)
    assert speed.s_per_token is None
    speed.observe(1000, 2.0)
    assert speed.s_per_token == pytest.approx(0.002)
    for _ in range(20):
        speed.observe(500, 2.0)  # the worker got four times slower
    assert speed.s_per_token == pytest.approx(0.004, rel=0.01)
    speed.observe(0, 1.0)  # nothing to learn from
    speed.observe(10, 0.0)
    assert speed.num_samples == 23


def test_an_old_estimate_weighs_less_the_longer_ago_its_samples_were_taken():
    """Samples age: after a quiet spell of many half-lives the first new sample all but replaces the
    estimate, where back to back it moves it by the usual EWMA weight (issue 36, item 8)."""
    now = [0.0]
    speed = PrefillSpeed(clock=lambda: now[0], half_life_s=60.0)
    for _ in range(3):
        speed.observe(1000, 2.0)
    speed.observe(500, 2.0)  # back to back: a quarter of the way from 0.002 to 0.004
    assert speed.s_per_token == pytest.approx(0.0025)
    now[0] += 600.0  # ten half-lives later the worker is four times as slow as first learned
    speed.observe(250, 2.0)
    assert speed.s_per_token == pytest.approx(0.008, rel=0.01)
