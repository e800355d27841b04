"""Children started with `python -m` never import from the working directory and get a trimmed
environment (issue 36, item 9): the helpers, and the two places that start pdserve's own children."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.api.config import WorkerConfig
from pdserve.app import ranks as ranks_module
from pdserve.api.child_process import child_environment, python_module_command


def test_a_module_in_the_working_directory_is_not_imported_by_a_child(tmp_path):
    (tmp_path / "planted.py").write_text("open('ran', 'w').write('yes')\n")
    child = subprocess.run(python_module_command("planted"), cwd=tmp_path, capture_output=True, text=True,
                           env=child_environment())
    assert child.returncode != 0 and "No module named planted" in child.stderr
    assert not (tmp_path / "ran").exists()


def test_the_environment_keeps_what_a_worker_reads_and_drops_the_rest():
    parent = {"PATH": "/usr/bin", "HOME": "/home/u", "LC_ALL": "C", "UCX_TLS": "tcp", "PDSERVE_CACHE_DIR": "/c",
              "CUDA_VISIBLE_DEVICES": "0", "AWS_SECRET_ACCESS_KEY": "k", "LD_PRELOAD": "/tmp/x.so",
              "PYTHONSTARTUP": "/tmp/s.py", "PYTHONHOME": "/tmp", "PYTHONPATH": "/src::relative:/more"}
    env = child_environment({"EXTRA": "1"}, parent)
    assert env == {"PATH": "/usr/bin", "HOME": "/home/u", "LC_ALL": "C", "UCX_TLS": "tcp",
                   "PDSERVE_CACHE_DIR": "/c", "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/src:/more", "EXTRA": "1"}


def test_tensor_parallel_ranks_start_with_safe_path_and_a_trimmed_environment(monkeypatch):
    started = []

    class FakePopen:
        def __init__(self, argv, env, preexec_fn=None, **kwargs):
            started.append((argv, env))
            self.pid = 4242

    monkeypatch.setattr(ranks_module.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "k")
    config = WorkerConfig.model_validate({"role": "colocated", "parallel": {"tensor_parallel_size": 2}})
    local = ranks_module.start_local_ranks(config)
    os.close(local.rendezvous_fd)
    [(argv, env)] = started
    assert argv[:4] == [sys.executable, "-P", "-m", "pdserve.app.ranks"]
    assert "AWS_SECRET_ACCESS_KEY" not in env and ranks_module.CONFIG_VARIABLE in env
