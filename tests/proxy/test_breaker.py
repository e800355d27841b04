"""Circuit breaker state machine, driven by a fake clock."""

from __future__ import annotations

from proxy.breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(threshold: int = 3, cooldown_s: float = 5.0) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(threshold, cooldown_s, clock), clock


def test_breaker_opens_only_after_threshold_consecutive_failures():
    breaker, _ = make(threshold=3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allows_request()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows_request()


def test_success_resets_the_consecutive_failure_count():
    breaker, _ = make(threshold=3)
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_breaker_half_opens_after_cooldown_and_lets_one_trial_through():
    breaker, clock = make(threshold=1, cooldown_s=5.0)
    breaker.record_failure()
    clock.now_s += 4.9
    assert not breaker.allows_request()
    clock.now_s += 0.2
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_request()
    assert breaker.on_request_start() is True
    assert not breaker.allows_request()  # the trial is in flight: nobody else
    assert breaker.on_request_start() is False  # and nobody else is a trial


def test_successful_trial_closes_the_breaker():
    breaker, clock = make(threshold=1)
    breaker.record_failure()
    clock.now_s += 6
    trial = breaker.on_request_start()
    breaker.record_success(trial)
    assert breaker.state is BreakerState.CLOSED and breaker.num_consecutive_failures == 0


def test_failed_trial_reopens_for_a_full_cooldown():
    breaker, clock = make(threshold=2, cooldown_s=5.0)
    breaker.record_failure()
    breaker.record_failure()
    clock.now_s += 6
    trial = breaker.on_request_start()
    breaker.record_failure(trial)
    assert breaker.state is BreakerState.OPEN
    clock.now_s += 4.9
    assert breaker.state is BreakerState.OPEN
    clock.now_s += 0.2
    assert breaker.state is BreakerState.HALF_OPEN


def test_neutral_end_of_a_trial_frees_the_trial_slot():
    breaker, clock = make(threshold=1)
    breaker.record_failure()
    clock.now_s += 6
    trial = breaker.on_request_start()
    breaker.record_neutral(trial)  # the client went away: no verdict
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_request()


def test_requests_sent_before_the_breaker_opened_do_not_decide_it():
    breaker, clock = make(threshold=1)
    old = breaker.on_request_start()  # in flight while the breaker is closed
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    breaker.record_success(old)  # the old request ends well: the breaker stays open
    assert breaker.state is BreakerState.OPEN
    clock.now_s += 6
    trial = breaker.on_request_start()
    breaker.record_success(False)  # another old one: still only the trial decides
    breaker.record_failure(False)
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows_request()
    breaker.record_success(trial)
    assert breaker.state is BreakerState.CLOSED
