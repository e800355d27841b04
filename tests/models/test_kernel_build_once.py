"""Processes that need the same native library at once build it once (pdserve.kernels.native.build_once):
the first holds the lock while it builds, the others wait and then find the library; a holder that never
lets go is waited for only so long."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import time

from pdserve.kernels.native import build_once

CONTEXT = multiprocessing.get_context("fork")  # no torch work in the children: only files and locks


def slow_build(path: str) -> None:
    with open(path + ".builds", "a") as f:  # one line per build, whoever ran it
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough that the other processes arrive while it runs
    with open(path + ".partial", "w") as f:
        f.write("library")
    os.replace(path + ".partial", path)


def needs_library(path: str, started) -> None:  # noqa: ANN001
    started.wait()
    build_once(path, slow_build, poll_s=0.01)
    assert open(path).read() == "library"


def test_three_processes_wanting_one_library_build_it_once(tmp_path):
    path = str(tmp_path / "cache" / "cpu_kernels-key.so")
    started = CONTEXT.Event()
    children = [CONTEXT.Process(target=needs_library, args=(path, started)) for _ in range(3)]
    for child in children:
        child.start()
    started.set()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert len(open(path + ".builds").read().split()) == 1


def test_a_lock_held_past_the_wait_does_not_stop_this_process_from_building(tmp_path):
    path = str(tmp_path / "cpu_kernels-key.so")
    holder = os.open(path + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process that hangs while building
    try:
        started_s = time.monotonic()
        build_once(path, slow_build, wait_s=0.2, poll_s=0.01)
        assert open(path).read() == "library" and time.monotonic() - started_s < 30
    finally:
        os.close(holder)


def test_a_library_already_built_is_not_built_again(tmp_path):
    path = str(tmp_path / "cpu_kernels-key.so")
    slow_build(path)
    build_once(path, slow_build)
    assert len(open(path + ".builds").read().split()) == 1
