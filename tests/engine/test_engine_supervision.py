"""Engine supervision with a real engine (tiny Qwen3): a fault in one request's sampling or output
processing fails that request only; a fault of the loop itself makes the worker say so on /live."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pdserve.api.errors import EngineFailure, RequestFailed
from pdserve.api.sampling import FinishReason
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric
from tests.engine.harness import Collected, generate, greedy, make_engine
from tests.engine.inprocess import start_worker
from tests.tiny_models import make_tiny_qwen3

PROMPT = [11 + (5 * j) % 250 for j in range(24)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return directory


@pytest.fixture(scope="module")
def engine(qwen_dir):
    return make_engine(qwen_dir, block_size=4, num_blocks=256)


def run_pair(built, good_id: str, bad_id: str) -> tuple[Collected, Collected]:
    loop = built.engine.engine_loop
    good, bad = Collected(), Collected()
    loop.submit(GenerationRequest(good_id, tuple(PROMPT), greedy(8)), good.outputs.append)
    loop.submit(GenerationRequest(bad_id, tuple(PROMPT[::-1]), greedy(8)), bad.outputs.append)
    loop.run_until_idle()
    return good, bad


def assert_only_the_bad_request_failed(built, clean: Collected, good: Collected, bad: Collected) -> None:
    assert good.token_ids == clean.token_ids and good.final.finish_reason is FinishReason.LENGTH
    assert bad.final.finished and bad.final.finish_reason is FinishReason.ERROR
    assert isinstance(bad.final.error, EngineFailure)
    after = generate(built, [PROMPT], greedy(8), prefix="after")[0]
    assert after.token_ids == clean.token_ids
    built.kv_manager.check_invariants()
    assert built.kv_manager.pool.num_in_use_by_group(0) == 0, "a failed request kept its blocks"
    assert len(built.engine.request_ids) == 0


def test_a_sampler_fault_for_one_request_fails_only_that_request(engine, monkeypatch):
    clean = generate(engine, [PROMPT], greedy(8), prefix="clean")[0]
    sampler = engine.runner.sampler
    original = sampler.sample_packed

    def faulty(*args, **kwargs):
        chunks = [item for arg in args if isinstance(arg, list) for item in arg if isinstance(item, ScheduledChunk)]
        if any(chunk.request_id.startswith("bad") for chunk in chunks):
            raise RuntimeError("injected sampler fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(sampler, "sample_packed", faulty)
    for request_id in ("good-s", "bad-s"):
        engine.engine.request_ids.reserve(request_id)
    good, bad = run_pair(engine, "good-s", "bad-s")
    monkeypatch.undo()
    assert_only_the_bad_request_failed(engine, clean, good, bad)


def test_invalid_logits_in_one_row_fail_only_that_request_in_one_pass(engine, monkeypatch):
    clean = generate(engine, [PROMPT], greedy(8), prefix="clean")[0]
    sampler = engine.runner.sampler
    original = sampler.sample_on_device
    batch_sizes = []

    def poisoned(logits, chunks, allowed=None):
        batch_sizes.append(len(chunks))
        for row, chunk in enumerate(chunks):
            if chunk.request_id.startswith("bad") and chunk.num_sampled_so_far == 2:
                logits[row, 0] = float("nan")
        return original(logits, chunks, allowed)

    monkeypatch.setattr(sampler, "sample_on_device", poisoned)
    for request_id in ("good-n", "bad-n"):
        engine.engine.request_ids.reserve(request_id)
    good, bad = run_pair(engine, "good-n", "bad-n")
    monkeypatch.undo()
    assert len(bad.token_ids) == 2 and isinstance(bad.final.error, RequestFailed)
    assert 1 not in batch_sizes[:3], "the batch was not split up and retried: one failed row is not a failed step"
    assert_only_the_bad_request_failed(engine, clean, good, bad)


def test_an_output_processor_fault_for_one_request_fails_only_that_request(engine, monkeypatch):
    clean = generate(engine, [PROMPT], greedy(8), prefix="clean")[0]
    processor = engine.engine.engine_loop.emitter.processor
    original = processor.process

    def faulty(request, *args, **kwargs):
        if request.request_id.startswith("bad") and len(request.output_token_ids) == 3:
            raise RuntimeError("injected output fault")
        return original(request, *args, **kwargs)

    monkeypatch.setattr(processor, "process", faulty)
    for request_id in ("good-o", "bad-o"):
        engine.engine.request_ids.reserve(request_id)
    good, bad = run_pair(engine, "good-o", "bad-o")
    monkeypatch.undo()
    assert len(bad.token_ids) == 2, "the tokens before the fault were delivered"
    assert_only_the_bad_request_failed(engine, clean, good, bad)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_dead_engine_loop_fails_live_within_a_second_and_its_requests_get_an_error(qwen_dir):
    worker = start_worker("colocated", qwen_dir, FakeFabric())
    try:
        async with worker.client() as client:
            assert (await client.get("/live")).status_code == 200
            engine_loop = worker.built.engine.engine_loop
            processor = engine_loop.emitter.processor
            original = processor.process
            fault_queued = threading.Event()

            def broken() -> None:
                raise RuntimeError("injected fault in the engine loop itself")

            def queue_fault_mid_request(request, *args, **kwargs):
                # On the engine thread, with 397 of 400 tokens still to go: the fault lands at the
                # loop's next iteration, so the request is certainly in flight when the loop dies.
                if len(request.output_token_ids) == 3 and not fault_queued.is_set():
                    engine_loop.call_soon(broken)
                    fault_queued.set()
                return original(request, *args, **kwargs)

            processor.process = queue_fault_mid_request
            in_flight = asyncio.create_task(client.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}))
            while not fault_queued.is_set():
                assert not in_flight.done(), "the request ended before the fault was queued"
                await asyncio.sleep(0.01)
            killed_s = time.monotonic()
            while (await client.get("/live")).status_code == 200:
                assert time.monotonic() - killed_s < 10.0, "/live still says alive"  # a dead loop's /live would stay 200
                await asyncio.sleep(0.02)
            assert (await client.get("/health")).status_code == 503
            response = await asyncio.wait_for(in_flight, 5)
            assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
            refused = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert refused.status_code == 503
    finally:
        worker.close()


def test_the_worker_server_exits_with_failure_once_its_engine_is_dead():
    import threading

    import uvicorn
    from fastapi import FastAPI

    from pdserve.app.drain import DrainingServer
    from tests.integration.cluster import free_port

    alive = threading.Event()
    alive.set()
    server = DrainingServer(uvicorn.Config(FastAPI(), port=free_port(), log_level="warning"), lambda: None, 1.0,
                            is_alive=alive.is_set)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started and not server.died
    alive.clear()
    thread.join(5)
    assert not thread.is_alive() and server.died
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.config.port}/", timeout=1)
