"""An engine whose queued work cannot run (the pool is full of blocks pinned for a decode worker)
waits for news instead of spinning a core, and runs the work as soon as the blocks come back."""

from __future__ import annotations

import time

import pytest

from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric
from tests.engine.harness import Collected, greedy
from tests.engine.inprocess import start_worker
from tests.tiny_models import make_tiny_qwen3

PROMPT = tuple(11 + (5 * j) % 250 for j in range(30))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return directory


def test_unschedulable_work_waits_on_events_instead_of_spinning(qwen_dir):
    # 15 usable blocks of 4 tokens: one pinned 30-token prefill leaves too few for another.
    prefill = start_worker("prefill", qwen_dir, FakeFabric(), num_blocks=16,
                           transfer={"lease_s": 600, "max_pinned_share": 1.0})
    loop = prefill.built.engine.engine_loop
    iterations = [0]
    original = loop.iterate

    def counted() -> None:
        iterations[0] += 1
        original()

    loop.iterate = counted  # the thread looks the method up on each turn
    try:
        pinned, waiting = Collected(), Collected()
        loop.submit(GenerationRequest("pinned", PROMPT, greedy(1), remote_decode=True), pinned.outputs.append)
        assert wait(lambda: pinned.outputs and pinned.final.finished, 30)
        assert pinned.final.kv_transfer_params is not None
        loop.submit(GenerationRequest("starved", PROMPT[::-1], greedy(4)), waiting.outputs.append)
        time.sleep(0.3)
        assert loop.scheduler.num_waiting == 1, "the starved request should be queued"
        start_count = iterations[0]
        time.sleep(1.0)
        spins = iterations[0] - start_count
        # Pinned blocks keep the connector polling every few ms; a spinning loop turns ~100k times a second.
        assert spins < 400, f"{spins} loop turns in one second with nothing schedulable"
        assert not waiting.outputs
        prefill.built.release_pinned("pinned", pinned.final.kv_transfer_params.remote_pin_nonce)
        assert wait(lambda: waiting.outputs and waiting.final.finished, 30)
        assert len(waiting.token_ids) == 4
    finally:
        loop.iterate = original
        prefill.close()


def wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
