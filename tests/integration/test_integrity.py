"""Never a 200 with wrong tokens: forged, swapped, stale and replayed kv_transfer_params against real
workers (real processes, real HTTP, real NIXL over UCX on host memory), run as llm-d runs them: no
internal token, so anyone who reaches the decode worker may send it any params.

Every case ends with the greedy text of the request's own prompt (computed by the decode worker alone,
no prefix cache) or a non-2xx; the decode worker's recompute counter names why it computed a prompt
itself. One prefill and one decode worker serve the whole module. Orderings are forced through what the
workers report (a pin gone, a lease expired), never by sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from pdserve.api.kv_transfer import KV_RECOMPUTED_HEADER, RemotePrefillParams
from pdserve.pd.tickets import TicketClient
from tests.integration.cluster import Worker, decode_leg, free_port, prefill_leg, start_workers, stop_all, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LEASE_S = 3.0  # short, so the expired-lease case waits little; D renews while it holds a request
PATH = "/v1/completions"
PIN_FIELDS = ("remote_request_id", "remote_engine_id", "remote_epoch", "remote_pin_nonce")
# Prompts of equal token counts (checked below) over several blocks: swapping their params passes every
# length check, and reversing a block list changes what it names.
PREAMBLE = ("You are a patient geography teacher. Answer each question in one short sentence, name the city "
            "first, and add one fact about its river or its history. ")
FRANCE = PREAMBLE + "The capital of France is a city called"
SPAIN = PREAMBLE + "The capital of Spain is a city called"


def body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("integrity-logs")
    common = ["--num-blocks", "200"]
    prefill = Worker("prefill", free_port(), str(logs / "prefill.log"), [*common, "--kv-lease-s", str(LEASE_S)],
                     device)
    decode = Worker("decode", free_port(), str(logs / "decode.log"), [*common, "--no-prefix-caching"], device)
    workers = start_workers(prefill, decode)
    yield workers  # [prefill, decode]; the restart cases at the end replace a worker in place
    stop_all(*workers)


@pytest.fixture(scope="module")
def expected(cluster) -> dict[str, str]:
    """Each prompt's greedy text from the decode worker alone, and a check that the swap prompts align."""
    _, decode = cluster
    answers = {}
    for prompt in (FRANCE, SPAIN):
        response = httpx.post(decode.url + PATH, json=body(prompt), timeout=120)
        assert response.status_code == 200, response.text
        answers[prompt] = response.json()["choices"][0]["text"]
        answers[prompt + "#tokens"] = response.json()["usage"]["prompt_tokens"]
    assert answers[FRANCE + "#tokens"] == answers[SPAIN + "#tokens"], "the swap prompts must be of one length"
    assert answers[FRANCE] != answers[SPAIN], "the swap prompts must answer differently"
    assert answers[FRANCE + "#tokens"] > 2 * 16, "the prompts must span three blocks"
    return answers


def recomputed(decode: Worker, reason: str) -> float:
    name = "pdserve_pd_recomputed_prompt_tokens_total"
    total = 0.0
    for line in httpx.get(decode.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def pinned(prefill: Worker) -> float:
    return prefill.metric("pdserve_transfer_pinned_blocks")


def pin(prefill: Worker, prompt: str, request_id: str) -> dict:
    response = prefill_leg(prefill, PATH, body(prompt), request_id)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def decode_text(decode: Worker, prompt: str, params: dict, request_id: str) -> tuple[int, str]:
    recomputed_before = decode.metric("pdserve_pd_recomputed_prompt_tokens_total")
    response = decode_leg(decode, PATH, body(prompt), params, request_id)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
    if response.status_code == 200:  # D tells the proxy whether it computed the prompt itself, as it counts
        computed_here = decode.metric("pdserve_pd_recomputed_prompt_tokens_total") > recomputed_before
        assert (response.headers.get(KV_RECOMPUTED_HEADER) == "1") == computed_here
    return response.status_code, text


def release(prefill: Worker, params: dict, **changes) -> int:
    payload = {key: params[key] for key in PIN_FIELDS} | changes
    return httpx.post(prefill.internal_url + "/internal/kv/release", json=payload, timeout=10).status_code


def assert_right_or_refused(status: int, text: str, want: str) -> None:
    assert status != 200 or text == want, f"a 200 with other tokens: {text!r} for {want!r}"


@pytest.fixture(autouse=True)
def no_pins_between_cases(cluster):
    prefill, _ = cluster
    assert wait_for(lambda: pinned(prefill) == 0, 3 * LEASE_S + 10), "an earlier case left a pin"
    yield


def test_the_control_pulls_and_answers_the_prompts_own_text(cluster, expected):
    prefill, decode = cluster
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    status, text = decode_text(decode, FRANCE, pin(prefill, FRANCE, "control"), "control")
    assert (status, text) == (200, expected[FRANCE])
    assert decode.metric("pdserve_transfer_bytes_total") > bytes_before, "the KV was pulled"


def test_the_params_of_one_prompt_sent_with_another_are_never_read(cluster, expected):
    prefill, decode = cluster
    before = recomputed(decode, "prompt_mismatch")
    status, text = decode_text(decode, SPAIN, pin(prefill, FRANCE, "swap-p"), "swap-d")
    assert (status, text) == (200, expected[SPAIN])
    assert recomputed(decode, "prompt_mismatch") == before + expected[SPAIN + "#tokens"]


@pytest.mark.parametrize("forge", ["reversed", "out_of_range", "another_live_pin"])
def test_client_block_ids_are_ignored_whatever_they_name(cluster, expected, forge):
    prefill, decode = cluster
    params = pin(prefill, FRANCE, f"ids-{forge}")
    other = pin(prefill, SPAIN, f"ids-{forge}-other") if forge == "another_live_pin" else None
    forged_ids = {"reversed": [list(reversed(ids)) for ids in params["remote_block_ids"]],
                  "out_of_range": [[10**6 + i for i, _ in enumerate(ids)] for ids in params["remote_block_ids"]],
                  "another_live_pin": other["remote_block_ids"] if other else None}[forge]
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    status, text = decode_text(decode, FRANCE, {**params, "remote_block_ids": forged_ids}, f"ids-{forge}")
    assert (status, text) == (200, expected[FRANCE])
    assert decode.metric("pdserve_transfer_bytes_total") > bytes_before, "P's own block ids were read"
    if other is not None:
        assert release(prefill, other) == 202


@pytest.mark.parametrize("forge", ["unknown_request_id", "wrong_nonce"])
def test_a_ticket_p_does_not_hold_is_computed_locally(cluster, expected, forge):
    prefill, decode = cluster
    params = pin(prefill, FRANCE, f"forge-{forge}")
    change = {"remote_request_id": "never-pinned"} if forge == "unknown_request_id" else {"remote_pin_nonce": "0" * 32}
    before = recomputed(decode, "stale_ticket")
    assert_right_or_refused(*decode_text(decode, FRANCE, {**params, **change}, f"forge-{forge}"), expected[FRANCE])
    assert recomputed(decode, "stale_ticket") > before
    assert pinned(prefill) > 0, "the forged ticket touched the real pin"
    assert release(prefill, params) == 202


def test_a_consumed_ticket_reused_after_p_reused_its_blocks_is_never_read(cluster, expected):
    prefill, decode = cluster
    params = pin(prefill, FRANCE, "consumed")
    assert decode_text(decode, FRANCE, params, "consumed") == (200, expected[FRANCE])
    assert wait_for(lambda: pinned(prefill) == 0, 10), "D's read released the pin"
    status, text = decode_text(decode, SPAIN, pin(prefill, SPAIN, "reuser"), "reuser")  # P's blocks hold Spain now
    assert (status, text) == (200, expected[SPAIN])
    before = recomputed(decode, "stale_ticket")
    assert decode_text(decode, FRANCE, params, "consumed-again") == (200, expected[FRANCE])
    assert recomputed(decode, "stale_ticket") > before


def test_a_ticket_whose_lease_expired_is_never_read(cluster, expected):
    prefill, decode = cluster
    expired_before = prefill.metric("pdserve_transfer_expired_leases_total")
    params = pin(prefill, FRANCE, "expired")
    assert wait_for(lambda: prefill.metric("pdserve_transfer_expired_leases_total") > expired_before, 3 * LEASE_S + 10)
    before = recomputed(decode, "stale_ticket")
    assert decode_text(decode, FRANCE, params, "expired") == (200, expected[FRANCE])
    assert recomputed(decode, "stale_ticket") > before


def test_a_pin_released_before_d_reads_is_never_read_and_only_its_nonce_releases_it(cluster, expected):
    prefill, decode = cluster
    params = pin(prefill, FRANCE, "cancelled")
    rejected_before = prefill.metric("pdserve_transfer_rejected_messages_total")
    assert release(prefill, params, remote_pin_nonce=None) == 400  # a bare request id frees nothing
    assert release(prefill, params, remote_pin_nonce="0" * 32) == 202  # accepted, then ignored by the engine
    assert wait_for(lambda: prefill.metric("pdserve_transfer_rejected_messages_total") > rejected_before, 10)
    assert pinned(prefill) > 0
    assert release(prefill, params) == 202  # the proxy gives up on the decode leg
    assert wait_for(lambda: pinned(prefill) == 0, 10)
    before = recomputed(decode, "stale_ticket")
    assert decode_text(decode, FRANCE, params, "cancelled") == (200, expected[FRANCE])
    assert recomputed(decode, "stale_ticket") > before


def test_params_of_an_earlier_start_of_the_prefill_worker_are_a_409(cluster, expected):
    """What D sees when P restarted between the legs: P's route names another epoch (the restart itself,
    re-handshaked transparently, is in test_pd_failures)."""
    prefill, decode = cluster
    params = pin(prefill, FRANCE, "earlier-start")
    status, _ = decode_text(decode, FRANCE, {**params, "remote_epoch": "0123456789abcdef"}, "earlier-start")
    assert status == 409
    assert release(prefill, params) == 202


def restart(cluster: list, index: int) -> Worker:
    old = cluster[index]
    old.kill()
    cluster[index] = Worker(old.role, old.port, old.log_path, old.extra_args, old.device,
                            internal_port=old.internal_port)  # a restarted pod keeps its ports
    start_workers(cluster[index])
    return cluster[index]


def test_a_prefill_worker_restarted_between_the_legs_gets_a_409_then_serves(cluster, expected):
    prefill, decode = cluster
    params = pin(prefill, FRANCE, "before-p-restart")
    prefill = restart(cluster, 0)  # same address, a fresh epoch, an empty pool
    status, _ = decode_text(decode, FRANCE, params, "before-p-restart")
    assert status == 409
    bytes_before = decode.metric("pdserve_transfer_bytes_total")
    assert decode_text(decode, FRANCE, pin(prefill, FRANCE, "after-p-restart"), "after-p-restart") == \
        (200, expected[FRANCE])
    assert decode.metric("pdserve_transfer_bytes_total") > bytes_before, "D handshook the new P and pulled"


def test_a_decode_worker_restarted_between_the_legs_answers_the_prompts_own_text(cluster, expected):
    prefill, _ = cluster
    params = pin(prefill, SPAIN, "before-d-restart")
    decode = restart(cluster, 1)  # the pin may outlive the restart or not (3 s lease): either way, right text
    assert decode_text(decode, SPAIN, params, "before-d-restart") == (200, expected[SPAIN])


def test_what_the_ticket_exchange_adds_to_the_handoff(cluster):
    """The ticket claim D makes before each READ, timed with D's own client against the live P (printed
    for docs/benchmarks.md; asserts nothing about time)."""
    prefill, _ = cluster
    client = TicketClient(None)

    async def claim_ms(params: RemotePrefillParams) -> float:
        started = time.perf_counter()
        await client.claim(params)
        return (time.perf_counter() - started) * 1e3

    times_ms = []
    for i in range(10):  # each claimed at once: the short lease runs out in seconds
        params = RemotePrefillParams.model_validate(pin(prefill, FRANCE, f"timed-{i}"))
        times_ms.append(asyncio.run(claim_ms(params)))
        assert release(prefill, params.model_dump()) == 202
    times_ms.sort()
    print(f"\nticket exchange: median {statistics.median(times_ms):.2f} ms, "
          f"p90 {times_ms[int(0.9 * len(times_ms)) - 1]:.2f} ms over {len(times_ms)} claims")
