"""A failed test's report carries its workers' logs (warnings and errors first); a passed one's does not."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.cluster import REPO_ROOT

CASES = '''
from dataclasses import dataclass

import pytest


@dataclass
class FakeWorker:
    role: str
    log_path: str


@pytest.fixture
def cluster(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text("2026-11-27 10:00:00,000 INFO a: started\\n"
                   "2026-11-27 10:00:01,000 ERROR pdserve.transfer: the agent died\\n"
                   + "".join(f"line {i}\\n" for i in range(2000)))
    return ("family", FakeWorker("decode", str(log)))


def test_fails(cluster):
    assert False


def test_passes(cluster):
    pass
'''


def test_a_failure_shows_the_alerts_and_the_tail_of_its_workers_logs(tmp_path):
    (tmp_path / "test_case.py").write_text(CASES)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.worker_logs", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout
    assert run.stdout.count("log of decode") == 1  # the failure's section only
    section = run.stdout.split("log of decode", 1)[1]
    assert "ERROR pdserve.transfer: the agent died" in section
    assert "line 1999" in section and "line 5\n" not in section  # the tail, not the whole log
