"""When a dead NIXL agent process is replaced (pdserve/transfer/agent_restart.py), on a fake clock
and fake agents: nothing blocks, a replacement that fails is retried after a growing backoff, one
that never comes up is given up on, and a success resets the backoff. Its set-up (registering
memory) runs on a helper thread; most tests run it inline, in the order they choose."""

from __future__ import annotations

import threading

import pytest

from pdserve.transfer.agent_client import AgentProcessDied
from pdserve.transfer.agent_restart import AgentRestart


class FakeAgent:
    def __init__(self, name: str, ready_after: int = 0, dies: bool = False):
        self.name, self.polls, self.ready_after, self.dies, self.closed = name, 0, ready_after, dies, False

    def ready(self) -> bool:
        self.polls += 1
        if self.dies:
            raise AgentProcessDied(f"{self.name} died while starting")
        return self.polls > self.ready_after

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def inline(job):
    job()


class DeferredJobs:
    """A helper thread whose jobs run only when the test says."""

    def __init__(self):
        self.jobs = []

    def __call__(self, job):
        self.jobs.append(job)

    def run_all(self):
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


def test_nothing_is_replaced_until_a_death_begins_a_restart(clock):
    restart = AgentRestart(clock, run_in_background=inline)
    made = []
    assert not restart.advance(lambda name: made.append(name) or FakeAgent(name), "a-r1", lambda agent: None)
    assert made == []


def test_a_replacement_is_polled_without_blocking_and_set_up_once_ready(clock):
    restart = AgentRestart(clock, run_in_background=inline)
    restart.begin()
    agents, set_up = [], []
    new = lambda name: agents.append(FakeAgent(name, ready_after=2)) or agents[-1]  # noqa: E731
    assert not restart.advance(new, "a-r1", set_up.append)
    assert not restart.advance(new, "a-r1", set_up.append)
    assert restart.advance(new, "a-r1", set_up.append) == (agents[0], None)
    assert len(agents) == 1 and set_up == agents  # one process started, set up once
    assert not restart.advance(new, "a-r1", set_up.append)  # nothing left to replace


def test_failures_back_off_0_5_1_2_seconds_and_a_success_resets_the_backoff(clock):
    restart = AgentRestart(clock, max_backoff_s=30, run_in_background=inline)
    restart.begin()
    dying = lambda name: FakeAgent(name, dies=True)  # noqa: E731
    starts = []
    for expected_delay in (0.5, 1.0, 2.0):
        starts.append(clock.now)
        assert not restart.advance(dying, "a-r1", lambda agent: None)  # starts one; it dies
        clock.now += expected_delay - 0.01
        assert not restart.advance(lambda name: pytest.fail("started before the backoff ended"), "a-r1",
                                   lambda agent: None)
        clock.now += 0.01
    assert restart.advance(lambda name: FakeAgent(name), "a-r1", lambda agent: None)
    restart.begin()  # the next death starts at once again
    assert restart.advance(lambda name: FakeAgent(name), "a-r2", lambda agent: None)


def test_a_replacement_that_never_comes_up_is_closed_and_retried(clock):
    restart = AgentRestart(clock, start_timeout_s=10, run_in_background=inline)
    restart.begin()
    stuck = FakeAgent("stuck", ready_after=10**9)
    assert not restart.advance(lambda name: stuck, "a-r1", lambda agent: None)
    clock.now = 10.5
    assert not restart.advance(lambda name: stuck, "a-r1", lambda agent: None)
    assert stuck.closed
    clock.now += 0.5
    assert restart.advance(lambda name: FakeAgent(name), "a-r1", lambda agent: None)


def test_a_replacement_whose_set_up_fails_is_closed_and_retried(clock):
    restart = AgentRestart(clock, run_in_background=inline)
    restart.begin()
    first = FakeAgent("first")

    def refuse(agent):
        raise OSError(17, "address taken in the new process")

    assert not restart.advance(lambda name: first, "a-r1", refuse)
    assert first.closed
    clock.now += 0.5
    assert restart.advance(lambda name: FakeAgent(name), "a-r1", lambda agent: None)


def test_set_up_runs_off_the_engine_thread_and_advance_never_waits_for_it(clock):
    """Issue 36 item 7: registering memory with the replacement may take minutes (pinning)."""
    helper = DeferredJobs()
    restart = AgentRestart(clock, run_in_background=helper)
    restart.begin()
    agent = FakeAgent("a-r1")
    prepared_on = []
    release = threading.Event()

    def prepare(new_agent):
        prepared_on.append(threading.current_thread())
        release.wait(30)  # blocks its thread, never the caller of advance
        return "registrations"

    assert restart.advance(lambda name: agent, "a-r1", prepare) is None
    assert prepared_on == [] and len(helper.jobs) == 1  # handed off, not run here
    assert restart.advance(lambda name: pytest.fail("a second process"), "a-r1", prepare) is None
    thread = threading.Thread(target=helper.run_all)
    thread.start()
    assert restart.advance(lambda name: pytest.fail("a second process"), "a-r1", prepare) is None
    release.set()
    thread.join(30)
    assert prepared_on == [thread]
    assert restart.advance(lambda name: pytest.fail("a second process"), "a-r1", prepare) == (agent, "registrations")
    assert not agent.closed


def test_a_set_up_that_overruns_is_given_up_retried_and_its_agent_closed_when_it_ends(clock):
    helper = DeferredJobs()
    restart = AgentRestart(clock, set_up_timeout_s=100, run_in_background=helper)
    restart.begin()
    slow = FakeAgent("slow")
    assert restart.advance(lambda name: slow, "a-r1", lambda agent: "late") is None
    clock.now = 101
    assert restart.advance(lambda name: pytest.fail("started before the backoff"), "a-r1", lambda a: 0) is None
    assert not slow.closed  # its set-up still runs: the helper thread closes it when done
    helper.run_all()
    assert slow.closed
    clock.now += 0.5
    fresh = FakeAgent("fresh")
    assert restart.advance(lambda name: fresh, "a-r1", lambda agent: "ok") is None
    helper.run_all()
    assert restart.advance(lambda name: pytest.fail("a second process"), "a-r1", lambda a: 0) == (fresh, "ok")


def test_closing_during_a_set_up_closes_its_agent_once_the_set_up_ends(clock):
    helper = DeferredJobs()
    restart = AgentRestart(clock, run_in_background=helper)
    restart.begin()
    agent = FakeAgent("a-r1")
    assert restart.advance(lambda name: agent, "a-r1", lambda a: "registrations") is None
    restart.close()
    assert not agent.closed
    helper.run_all()
    assert agent.closed
    assert restart.advance(lambda name: pytest.fail("restarted after close"), "a-r1", lambda a: 0) is None
