"""The per-file time budget: module fixtures count towards their file, shared session fixtures are charged
once to a line of their own, listed files may take longer, and an over-budget file fails the run by name."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.file_budget import SESSION_LINE, SLOW_FILES, FileBudget
from tests.integration.cluster import REPO_ROOT

CONFTEST = '''
import time
import pytest

@pytest.fixture(scope="session")
def shared_cluster():
    time.sleep(0.8)
    return "started once"

@pytest.fixture(scope="module")
def own_cluster():
    time.sleep(0.8)
    return "started per module"
'''

SHARING = '''
import time

def test_reads_the_shared_cluster(shared_cluster):
    time.sleep(0.4)
'''

OWNING = '''
import time

def test_reads_its_own_cluster(own_cluster):
    time.sleep(0.4)
'''


def run_pytest(tmp_path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.file_budget", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path), *args],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)


def test_shared_session_fixtures_are_charged_once_and_module_fixtures_to_their_file(tmp_path):
    files = {"conftest.py": CONFTEST, "test_first_sharer.py": SHARING, "test_second_sharer.py": SHARING,
             "test_owner.py": OWNING}
    result = run_pytest(tmp_path, files, "--file-budget-s", "1.0")
    assert result.returncode == 1, result.stdout
    assert "3 passed" in result.stdout
    over = [line for line in result.stdout.splitlines() if "over the 1 s budget" in line]
    assert len(over) == 1 and over[0].startswith("test_owner.py took"), result.stdout
    assert f"{SESSION_LINE}shared_cluster" in result.stdout


def test_a_run_within_the_budget_passes_and_prints_the_slowest_files(tmp_path):
    result = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_owner.py": OWNING}, "--file-budget-s", "5")
    assert result.returncode == 0, result.stdout
    assert "slowest test files" in result.stdout and "test_owner.py" in result.stdout


def report(nodeid: str, when: str, duration_s: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration_s)


def finish(budget: FileBudget) -> SimpleNamespace:
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    budget.pytest_sessionfinish(session, pytest.ExitCode.OK)
    return session


def test_a_listed_file_may_take_longer_and_an_unlisted_one_fails_the_session():
    budget = FileBudget(10.0, allowed={"tests/slow.py": "starts four clusters"})
    for nodeid in ("tests/slow.py::test_a", "tests/other.py::test_b"):
        for when in ("setup", "call", "teardown"):
            budget.pytest_runtest_logreport(report(nodeid, when, 4.0))
    assert budget.seconds == {"tests/slow.py": 12.0, "tests/other.py": 12.0}
    assert finish(budget).exitstatus == pytest.ExitCode.TESTS_FAILED
    assert budget.over_budget == ["tests/other.py"]


def test_a_budget_of_zero_checks_nothing_and_an_unenforced_one_only_names_the_file():
    budget = FileBudget(0.0)
    budget.pytest_runtest_logreport(report("tests/x.py::test_a", "call", 1000.0))
    assert finish(budget).exitstatus == pytest.ExitCode.OK
    named = FileBudget(10.0, enforce=False)
    named.pytest_runtest_logreport(report("tests/x.py::test_a", "call", 1000.0))
    assert finish(named).exitstatus == pytest.ExitCode.OK and named.over_budget == ["tests/x.py"]


def test_every_listed_slow_file_exists_and_says_why():
    for path, reason in SLOW_FILES.items():
        assert os.path.isfile(os.path.join(REPO_ROOT, path)), path
        assert len(reason) > 20, path
