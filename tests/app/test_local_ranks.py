"""Stopping the ranks a worker started on this host (pdserve/app/ranks.stop_local_ranks)."""

from __future__ import annotations

import subprocess

from pdserve.app.ranks import stop_local_ranks


class FakeRank:
    """A Popen stand-in that stops only when killed (a rank nobody told to stop)."""

    pid = 4242

    def __init__(self):
        self.killed = False
        self.waits: list = []

    def wait(self, timeout=None):  # noqa: ANN001
        self.waits.append(timeout)
        if not self.killed and timeout is not None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return 0

    def kill(self) -> None:
        self.killed = True


def test_ranks_of_a_worker_stopped_before_its_engine_was_built_are_ended_without_waiting():
    # Before: SIGTERM while a TP=2 worker loaded left rank 1 waiting 10 s for a stop nobody sent.
    rank = FakeRank()
    stop_local_ranks([rank], timeout_s=10.0, told_to_stop=False)
    assert rank.killed and rank.waits == [None]


def test_ranks_told_to_stop_get_their_grace_then_are_killed():
    rank = FakeRank()
    stop_local_ranks([rank], timeout_s=0.01)
    assert rank.killed and rank.waits == [0.01, None]
