"""Cores that follow the work: each worker runs every core while its peer is idle and its own share as
soon as the peer has work; the two sides meet in one shared file (mapped twice here, as two
processes map it)."""

from __future__ import annotations

import os

import pytest

from pdserve.engine.core_share import CoreShare, create_ledger, open_core_share


def pair(tmp_path, narrow=1, wide=2):
    path = str(tmp_path / "ledger")
    create_ledger(path)
    calls = {"prefill": [], "decode": []}
    sides = {role: open_core_share(path, role, narrow, wide, calls[role].append) for role in calls}
    return sides["prefill"], sides["decode"], calls


def test_a_lone_worker_takes_every_core_and_narrows_once_its_peer_has_work(tmp_path):
    prefill, decode, calls = pair(tmp_path)
    assert calls == {"prefill": [1], "decode": [1]}  # both start narrow
    assert prefill.before_step(busy=True) == 2  # a long prefill while D is idle: the whole machine
    assert decode.before_step(busy=True) == 1  # D gets work while P prefills: its own share ...
    assert prefill.before_step(busy=True) == 1  # ... and P hands the other core back at its next step
    decode.publish(busy=False)  # the step that finished D's last request says so
    assert prefill.before_step(busy=True) == 2
    assert calls == {"prefill": [1, 2, 1, 2], "decode": [1]}  # set only when it changes
    assert prefill.num_changes == 3 and decode.num_changes == 0


def test_both_busy_never_run_wide_together(tmp_path):
    prefill, decode, _ = pair(tmp_path, narrow=2, wide=4)
    prefill.publish(True)
    decode.publish(True)
    for _ in range(3):
        assert prefill.before_step(True) + decode.before_step(True) == 4


def test_an_idle_peer_is_read_from_the_shared_file_not_a_local_copy(tmp_path):
    prefill, decode, _ = pair(tmp_path)
    decode.publish(True)
    again = open_core_share(str(tmp_path / "ledger"), "prefill", 1, 2, lambda threads: None)
    assert again.before_step(True) == 1  # a third mapping sees D's byte
    decode.publish(False)
    assert again.before_step(True) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefill and decode workers"):
        CoreShare(bytearray(64), "colocated", 1, 2, lambda threads: None)
    with pytest.raises(ValueError, match="own share"):
        CoreShare(bytearray(64), "prefill", 3, 2, lambda threads: None)


# ---- the ledger file is opened safely (issue 36, item 9) ----------------------------------------


def test_a_link_at_the_ledger_path_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(bytes(64))
    os.symlink(target, tmp_path / "ledger")
    with pytest.raises(ValueError, match="core ledger"):
        open_core_share(str(tmp_path / "ledger"), "prefill", 1, 2, lambda n: None)
    with pytest.raises(ValueError, match="core ledger"):
        create_ledger(str(tmp_path / "ledger"))


def test_a_ledger_of_the_wrong_size_or_owner_is_refused(tmp_path, monkeypatch):
    short = tmp_path / "short"
    short.write_bytes(b"\x00")  # mapping 64 bytes of it would fault on the first read past its end
    with pytest.raises(ValueError, match="1 bytes"):
        open_core_share(str(short), "decode", 1, 2, lambda n: None)
    path = str(tmp_path / "ledger")
    create_ledger(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(ValueError, match="owned by uid"):
        open_core_share(path, "decode", 1, 2, lambda n: None)
