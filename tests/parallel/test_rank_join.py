"""How the ranks of a tensor-parallel worker meet: the wait for a rank still starting is bounded by
the join timeout, not by the (much shorter) collective timeout, and rank 0 stops waiting as soon as
a rank it started has exited. Real torch.distributed (gloo) between real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pdserve.app.ranks import LocalRanks
from pdserve.parallel.errors import RanksLost
from pdserve.parallel.ranks import RankGroup
from pdserve.parallel.rendezvous import listen_on

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVE_TIMEOUT_S = 1.0
RANK_SCRIPT = f"""
import logging, sys, torch
from pdserve.parallel.ranks import RankGroup
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = RankGroup(rank, 2, "127.0.0.1", port, {COLLECTIVE_TIMEOUT_S}, torch.device("cpu"), join_timeout_s=60)
summed = group.all_reduce(torch.full((3,), float(rank + 1)))
print("summed", summed.tolist(), flush=True)
group.close()
"""


def start_rank(script: str, rank: int, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, str(rank), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": REPO})


def test_a_rank_that_starts_after_the_collective_timeout_is_still_met(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    with listen_on("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    leader = start_rank(str(script), 0, port)
    follower = None
    try:
        for line in leader.stdout:  # rank 0 is waiting for the others...
            if "meeting the other ranks" in line:
                break
        time.sleep(3 * COLLECTIVE_TIMEOUT_S)  # ...longer than a collective may take, before rank 1 even starts
        follower = start_rank(str(script), 1, port)
        outputs = [process.communicate(timeout=120)[0] for process in (leader, follower)]
    finally:
        for process in (leader, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert leader.returncode == 0 and follower.returncode == 0, outputs
    assert all("summed [3.0, 3.0, 3.0]" in output for output in outputs), outputs


def test_rank_zero_stops_waiting_when_a_rank_it_started_has_exited():
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait()
    listener = listen_on("127.0.0.1", 0)
    port = listener.getsockname()[1]
    local = LocalRanks(config=None, children=[child], rendezvous_fd=listener.detach())
    assert local.lost() == f"rank 1 (pid {child.pid}) exited with status 3"
    with pytest.raises(RanksLost, match=r"rank 1 \(pid \d+\) exited with status 3 before the ranks met"):
        RankGroup(0, 2, "127.0.0.1", port, COLLECTIVE_TIMEOUT_S, torch.device("cpu"), join_timeout_s=600,
                  listen_fd=local.rendezvous_fd, ranks_lost=local.lost)
