"""Tensor-parallel workers as real processes (gloo between the ranks, NIXL between P and D):
greedy parity with transformers at TP=2 (GQA, KV-head replication, Gemma 3's sliding window),
the embedded SmolLM2 at TP=3 equal to TP=1 and TP=2 refused, P/D at TP=2 with the KV really
pulled, ranks started as separate commands, and a lost rank taking only its own worker down."""

from __future__ import annotations

import os
import re
import subprocess
import time

import httpx
import pytest
import torch

from tests.integration.cluster import (Worker, decode_leg, free_port, page_bytes, prefill_leg, start_workers, stop_all,
                                       two_legs, wait_for)
from tests.models.hf_oracle import hf_greedy_with_margins, randomize_norms, save_tiny_checkpoint
from tests.tiny_models import GEMMA_VOCAB, GEMMA_WINDOW, make_tiny_gemma3, random_prompt

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

VOCAB = 300
NUM_NEW = 12
# A logit gap this small may flip under the all-reduce's other summation order (issue 19).
TIE_GAP = 1e-5


def tiny_llama(directory: str, heads: int, kv_heads: int, bias: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256, initializer_range=0.08,
        attention_bias=bias, mlp_bias=bias, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_norms(model, seed=seed)
    save_tiny_checkpoint(model, directory)
    return model


def token_ids(tokens: list[str]) -> list[int]:
    """The word-level test tokenizer's strings back to ids (tests/models/hf_oracle.py)."""
    special = {"<unk>": 0, "<eos>": 1, "<bos>": 2}
    return [special[t] if t in special else int(t.removeprefix("w")) for t in tokens]


def greedy(worker: Worker, prompt: list[int], max_tokens: int = NUM_NEW) -> list[int]:
    body = {"model": worker_model(worker), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    response = httpx.post(worker.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return token_ids(response.json()["choices"][0]["logprobs"]["tokens"])


def worker_model(worker: Worker) -> str:
    return httpx.get(worker.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def assert_greedy_parity(got: list[int], want: list[int], margins: list[float]) -> None:
    """Token for token; a first difference is accepted only right where transformers itself saw a
    near-tie (gap below TIE_GAP), and then the test says so rather than pass silently."""
    for step, (ours, theirs) in enumerate(zip(got, want)):
        if ours != theirs:
            assert margins[step] < TIE_GAP, f"step {step}: {ours} != {theirs} at a logit gap of {margins[step]}"
            pytest.xfail(f"greedy tokens diverge at step {step}, a near-tie ({margins[step]:.2e})")
    assert len(got) == len(want)


def tp_worker(role: str, model_dir: str, logs, name: str, *extra: str) -> Worker:
    return Worker(role, free_port(), str(logs / f"{name}.log"),
                  ["--model", model_dir, "--dtype", "float32", "--num-blocks", "96", "--block-size", "4", *extra])


CASES = {  # name: (query heads, KV heads, biases)
    "llama-4q-2kv-biases": (4, 2, True),
    "llama-2q-1kv-replicated": (2, 1, False),
}


@pytest.fixture(scope="module")
def tp2_workers(tmp_path_factory):
    """One TP=2 worker per tiny model, with its transformers oracle: {name: (oracle, vocab, checkpoint dir)}."""
    logs = tmp_path_factory.mktemp("tp-logs")
    oracles, workers = {}, {}
    for seed, (name, (heads, kv_heads, bias)) in enumerate(CASES.items()):
        directory = str(tmp_path_factory.mktemp(name))
        oracles[name] = (tiny_llama(directory, heads, kv_heads, bias, seed), VOCAB, directory)
        workers[name] = tp_worker("serve", directory, logs, name, "-tp", "2")
        if bias:  # the same model on one rank, for what transformers cannot answer
            workers["single"] = tp_worker("serve", directory, logs, "single")
    gemma_dir = str(tmp_path_factory.mktemp("gemma3"))
    oracles["gemma3-window"] = (make_tiny_gemma3(gemma_dir), GEMMA_VOCAB, gemma_dir)
    workers["gemma3-window"] = tp_worker("serve", gemma_dir, logs, "gemma3", "-tp", "2")
    start_workers(*workers.values())
    yield oracles, workers
    stop_all(*workers.values())


@pytest.mark.parametrize("name", [*CASES, "gemma3-window"])
def test_tp2_greedy_matches_transformers(tp2_workers, name):
    oracles, workers = tp2_workers
    oracle, vocab, _ = oracles[name]
    for seed, length in ((1, 9), (2, 3 * GEMMA_WINDOW + 5)):  # the second prompt outgrows Gemma's window
        prompt = random_prompt(length, vocab, seed)
        want, margins = hf_greedy_with_margins(oracle, prompt, NUM_NEW)
        assert_greedy_parity(greedy(workers[name], prompt), want, margins)
    assert workers[name].metric("pdserve_engine_tensor_parallel_ranks") == 2
    assert workers[name].metric("pdserve_engine_tensor_parallel_serving_ranks") == 2


def test_prompt_logprobs_and_seeded_sampling_at_tp2_match_one_rank(tp2_workers):
    """The eager path's two logits computations (sampling rows, prompt rows) over a vocabulary split
    between the ranks: the same tokens and, to summation order, the same logprobs as one rank."""
    _, workers = tp2_workers
    body = {"prompt": random_prompt(17, VOCAB, 11), "max_tokens": 8, "temperature": 0.9, "seed": 1234,
            "ignore_eos": True, "logprobs": 2, "echo": True}
    answers = []
    for worker in (workers["llama-4q-2kv-biases"], workers["single"]):
        response = httpx.post(worker.url + "/v1/completions", json={**body, "model": worker_model(worker)}, timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["logprobs"])
    split, whole = answers
    assert split["tokens"] == whole["tokens"] and len(split["tokens"]) == 17 + 8
    assert split["token_logprobs"][0] is None and whole["token_logprobs"][0] is None
    assert split["token_logprobs"][1:] == pytest.approx(whole["token_logprobs"][1:], abs=1e-4)
    assert [sorted(top) for top in split["top_logprobs"][1:]] == [sorted(top) for top in whole["top_logprobs"][1:]]


def test_ranks_started_as_separate_commands_serve_the_same_answers(tp2_workers, tmp_path):
    """The multi-host path: rank 0 and rank 1 each started as their own command, meeting at one port."""
    oracles, workers = tp2_workers
    name = "llama-4q-2kv-biases"
    model_dir = oracles[name][2]
    port = str(free_port())
    rendezvous = ["-tp", "2", "--tp-master-addr", "127.0.0.1", "--tp-master-port", port]
    leader = tp_worker("serve", model_dir, tmp_path, "rank0", *rendezvous, "--tp-rank", "0")
    rank1 = tp_worker("serve", model_dir, tmp_path, "rank1", *rendezvous, "--tp-rank", "1")
    rank1.start()  # the ranks may start in any order: rank 1 waits for rank 0's rendezvous
    try:
        start_workers(leader)
        prompt = random_prompt(13, VOCAB, 7)
        want, margins = hf_greedy_with_margins(oracles[name][0], prompt, NUM_NEW)
        assert_greedy_parity(greedy(leader, prompt), want, margins)
        assert greedy(leader, prompt) == greedy(workers[name], prompt)
        assert "started tensor-parallel ranks" not in leader.log_tail(200_000)  # it started no child of its own
    finally:
        leader.kill()  # rank 0 vanishes without a word: rank 1 must notice and exit, not hang
        rank1.stop()  # (only reached with rank 1 still up when an assertion above failed)
    assert rank1.process.wait(60) != 0
    assert "rank 1/2" in rank1.log_tail() and "exiting" in rank1.log_tail()


def test_a_rank_outlives_sigterm_until_rank_0_has_drained_and_stops_it(tp2_workers, tmp_path):
    """Every pod of a LeaderWorkerSet gets SIGTERM at once. Rank 1 must not leave while rank 0 still
    serves (every step needs it): it stays, answers keep coming, and it exits 0 once rank 0, stopped
    in turn, tells it to."""
    import signal

    oracles, workers = tp2_workers
    name = "llama-4q-2kv-biases"
    port = str(free_port())
    rendezvous = ["-tp", "2", "--tp-master-addr", "127.0.0.1", "--tp-master-port", port]
    leader = tp_worker("serve", oracles[name][2], tmp_path, "rank0", *rendezvous, "--tp-rank", "0")
    rank1 = tp_worker("serve", oracles[name][2], tmp_path, "rank1", *rendezvous, "--tp-rank", "1")
    rank1.start()
    try:
        start_workers(leader)
        prompt = random_prompt(11, VOCAB, 9)
        before = greedy(leader, prompt)
        rank1.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: "SIGTERM; serving on" in rank1.log_tail(), 30)
        assert greedy(leader, prompt) == before and rank1.process.poll() is None
        leader.stop()  # SIGTERM: rank 0 drains, then stops the ranks
        assert leader.process.wait(60) == 0
        assert rank1.process.wait(60) == 0
    finally:
        leader.kill()
        rank1.kill()


def test_a_worker_stopped_while_its_ranks_load_exits_cleanly(tp2_workers, tmp_path):
    """SIGTERM while the model still loads (its rank held stopped, so the load cannot end first): the
    worker ends its rank and exits 0 at once. It used to leave through the interpreter's finalization
    beside a loader thread inside torch.distributed, which aborted it (exit 134) about half the time."""
    import signal

    oracles, _ = tp2_workers
    worker = tp_worker("serve", oracles["llama-4q-2kv-biases"][2], tmp_path, "stopped", "-tp", "2").start()
    rank1 = None
    try:
        assert wait_for(lambda: "rank 1/2: control records and tensors" in worker.log_tail(), 120)
        rank1 = int(re.search(r"started tensor-parallel ranks 1-1 \(pids \[(\d+)\]\)", worker.log_tail(200_000))[1])
        os.kill(rank1, signal.SIGSTOP)  # forced order: the load now waits on rank 1 until the stop
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(60) == 0
        log = worker.log_tail(200_000)
        assert "the worker stopped before its engine was built" in log and "leaving without waiting" in log
        assert "terminate called" not in log
    finally:
        worker.kill()
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended by the worker, as it should be


# ---- the embedded model ------------------------------------------------------------------------


def test_smollm2_at_tp3_gives_the_tp1_text_and_tp2_is_refused_naming_the_numbers(tmp_path):
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 24, "temperature": 0}
    refused = Worker("serve", free_port(), str(tmp_path / "tp2.log"), ["-tp", "2", "--num-blocks", "64"]).start()
    texts = {}
    for size in (1, 3):
        worker = Worker("serve", free_port(), str(tmp_path / f"tp{size}.log"),
                        ["-tp", str(size), "--num-blocks", "64"])
        start_workers(worker)
        try:
            response = httpx.post(worker.url + "/v1/chat/completions", json=chat, timeout=120)
            assert response.status_code == 200, response.text
            texts[size] = response.json()["choices"][0]["message"]["content"]
        finally:
            worker.stop()
        if size > 1:  # an orderly stop of rank 0 stops the ranks it started
            assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in rank_pids(worker)), 30)
    assert texts[3] == texts[1] and len(texts[1]) > 20
    assert refused.process.wait(120) != 0
    assert "--tensor-parallel-size 2 does not divide the model's 9 attention heads" in refused.log_tail(100_000)


# ---- P/D -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_tp2(tmp_path_factory):
    """P and D at TP=2 (D fails rather than recomputes, so an answer proves every slice was pulled),
    and a single TP=1 worker on the same weights."""
    model_dir = str(tmp_path_factory.mktemp("pd-llama"))
    tiny_llama(model_dir, 4, 2, True, seed=5)
    logs = tmp_path_factory.mktemp("pd-logs")
    lease = ["--kv-lease-s", "6", "--kv-heartbeat-s", "1", "--kv-pull-timeout-s", "3"]
    prefill = tp_worker("prefill", model_dir, logs, "prefill", "-tp", "2", "--tp-timeout-s", "10", *lease)
    decode = tp_worker("decode", model_dir, logs, "decode", "-tp", "2", "--tp-timeout-s", "10",
                       "--kv-failure-policy", "fail", "--no-prefix-caching", *lease)
    single = tp_worker("serve", model_dir, logs, "single")
    workers = start_workers(prefill, decode, single)
    yield prefill, decode, single
    stop_all(*workers)


def test_pd_at_tp2_equals_one_worker_with_every_rank_slice_pulled(pd_tp2):
    prefill, decode, single = pd_tp2
    for seed, length in ((3, 29), (4, 50)):
        prompt = random_prompt(length, VOCAB, seed)
        body = {"model": worker_model(single), "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        expected = greedy(single, prompt)
        pulled_before = decode.metric("pdserve_transfer_descriptors_total")
        bytes_before = decode.metric("pdserve_transfer_bytes_total")
        params, response = two_legs(prefill, decode, "/v1/completions", body, f"tp-pd-{seed}")
        assert params["tp_size"] == 2
        assert response.status_code == 200, response.text
        assert token_ids(response.json()["choices"][0]["logprobs"]["tokens"]) == expected
        sent = sum(len(ids) for ids in params["remote_block_ids"])
        # Each decode rank reads its heads of every block from the same prefill rank, adjacent pages as one.
        assert decode.metric("pdserve_transfer_bytes_total") - bytes_before == 2 * sent * page_bytes(decode) > 0
        assert 2 <= decode.metric("pdserve_transfer_descriptors_total") - pulled_before <= 2 * sent
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)


def test_params_naming_another_tp_size_than_the_prefill_worker_runs_are_refused(pd_tp2):
    prefill, decode, single = pd_tp2
    body = {"model": worker_model(single), "prompt": random_prompt(9, VOCAB, 1), "max_tokens": 2}
    # A fresh pin (a ticket is claimed once), its params forged to name one rank.
    params = prefill_leg(prefill, "/v1/completions", body, "tp-size-probe").json()["kv_transfer_params"]
    response = decode_leg(decode, "/v1/completions", body, {**params, "tp_size": 1}, "tp-size-probe")
    assert response.status_code == 400 and "tp_size is 1" in response.json()["error"]["message"]


def rank_pids(worker: Worker) -> list[int]:
    """The pids of the ranks a worker started on this host (it logs them)."""
    found = re.search(r"started tensor-parallel ranks 1-\d+ \(pids \[([\d, ]+)\]\)", worker.log_tail(1_000_000))
    assert found, worker.log_tail()
    return [int(pid) for pid in found.group(1).split(",")]


def test_a_lost_rank_takes_its_worker_down_within_the_timeout_and_its_peer_survives(pd_tp2):
    """Runs last in this module: it kills ranks of the shared workers."""
    prefill, decode, single = pd_tp2
    body = {"model": worker_model(single), "prompt": random_prompt(21, VOCAB, 9), "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    # P pins a prompt's blocks for D; then D loses a rank before it ever reads them.
    first = httpx.post(prefill.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "tp-orphan"},
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200 and prefill.metric("pdserve_transfer_pinned_blocks") > 0
    killed_at = time.monotonic()
    for pid in rank_pids(decode):
        subprocess.run(["kill", "-9", str(pid)], check=True)
    assert decode.process.wait(60) != 0  # the collective timeout is 10 s, plus shutting down
    assert time.monotonic() - killed_at < 60
    # The prefill worker goes on: it serves, and the orphaned pin ends with its lease.
    assert httpx.get(prefill.url + "/health", timeout=10).status_code == 200
    assert wait_for(lambda: prefill.metric("pdserve_transfer_pinned_blocks") == 0, 30)
    answer = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200
    # Now P loses a rank: it says so and exits non-zero, and the lone worker beside it is untouched.
    for pid in rank_pids(prefill):
        subprocess.run(["kill", "-9", str(pid)], check=True)
    assert prefill.process.wait(60) != 0
    assert httpx.get(single.url + "/health", timeout=10).status_code == 200
