"""The session-end check fails a run whose tests leave a process alive, and kills what they left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.integration.cluster import REPO_ROOT

LEAKY = '''
import subprocess, sys

def test_starts_a_process_and_forgets_it(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (tmp_path.parent.parent / "leaked.pid").write_text(str(child.pid))

def test_starts_a_process_and_stops_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child.kill()
    child.wait()
'''

TIDY = '''
import subprocess, sys

def test_starts_a_process_and_stops_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child.terminate()
    child.wait()
'''


def run_pytest(tmp_path, source: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.process_guard", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)


def test_a_leaked_process_fails_the_session_and_is_killed(tmp_path):
    result = run_pytest(tmp_path, LEAKY)
    assert result.returncode == 1, result.stdout
    assert "2 passed" in result.stdout and "still alive at the end of the session" in result.stdout
    pid = int((tmp_path / "leaked.pid").read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z"


def test_a_tidy_session_passes(tmp_path):
    result = run_pytest(tmp_path, TIDY)
    assert result.returncode == 0, result.stdout


USES_MULTIPROCESSING = '''
import multiprocessing

def test_uses_a_spawn_queue_in_process():
    queue = multiprocessing.get_context("spawn").Queue()  # starts the resource tracker, which outlives the test
    queue.put(1)
    assert queue.get(timeout=10) == 1
'''


def test_the_multiprocessing_resource_tracker_is_not_a_leak(tmp_path):
    """It lives exactly as long as the pytest process that started it."""
    result = run_pytest(tmp_path, USES_MULTIPROCESSING)
    assert result.returncode == 0, result.stdout
    assert "still alive" not in result.stdout
