"""Peer pulls with real processes and real NIXL: two prefill workers of the embedded model. Worker A
computes a long prompt; the same prompt and more goes to worker B with a peer hint naming A: B reads
A's blocks of the prefix, computes only the new part, answers what A answers (greedy, token for
token), and A holds nothing pinned afterwards; the same from the decode worker that decoded a
conversation's first turn (it alone holds the answer's KV) for the next turn's prompt; the same when the holder's pool was too small to keep
the prefix and it sits only in the holder's offload tier (the holder loads it back, then pins it). A hint naming a dead peer, or sent without the internal
token, costs only a computed prompt with the same answer, and so does a holder killed after it pinned
and before the puller's READ (a relay in front of its internal port orders the two). Behind `pdserve proxy --policy round_robin
--peer-pull` (a decode worker added), interleaved conversations whose every later turn lands on the
prefill worker without its history compute what one worker with everything cached would."""

from __future__ import annotations

import http.server
import signal
import threading
from typing import Callable, Optional

import httpx
import pytest

from bench.lib.launch import metric_sum
from pdserve.api.peer_pull import PEER_HINT_HEADER, PEER_PIN_PATH, PeerHint
from pdserve.pd.peer_costs import DEFAULT_COMPUTE_S_PER_TOKEN, DEFAULT_PULL_S_PER_TOKEN
from tests.integration.cluster import (ProxyProcess, Worker, free_port, reset_prefix_cache, start_workers, stop_all,
                                       two_legs, wait_for)

pytestmark = pytest.mark.slow

TOKEN = "peer-pull-token"
AUTH = {"X-Pdserve-Internal-Token": TOKEN}
BLOCK = 16
# Repeatable pulls: every hint of a block or more is followed, whatever this machine's measured prices say
# (the measured decision: tests/pd/test_peer_costs.py).
PULL_EVERY_HINT = ["--peer-pull-min-tokens", str(BLOCK), "--peer-pull-decision", "threshold"]
PREFIX = [200 + (i * 37) % 900 for i in range(7 * BLOCK + 5)]  # 7 full blocks and a partial one


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, device):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--num-blocks", "200", "--internal-token", TOKEN, *PULL_EVERY_HINT]
    a, b = (Worker("prefill", free_port(), str(logs / f"{name}.log"), common, device) for name in "ab")
    decode = Worker("decode", free_port(), str(logs / "decode.log"), common, device)
    # A holder whose 15-block pool cannot keep a prefix, with a host-memory tier behind it (started here,
    # beside the others, rather than in a fixture of its own: one start-up wait for the module).
    tiered = Worker("prefill", free_port(), str(logs / "tiered.log"),
                    ["--num-blocks", "16", "--kv-offload-bytes", "64MiB", *common[2:]], device)
    started = start_workers(a, b, decode, tiered)
    backends = ["--prefill", a.url, b.url, "--decode", decode.url, "--internal-token", TOKEN, "--policy",
                "round_robin", "--health-interval-s", "0.2", "--peer-pull-margin-tokens", str(BLOCK)]
    proxies = {pulls: ProxyProcess(free_port(), str(logs / f"proxy-{pulls}.log"),
                                   [*backends, "--peer-pull" if pulls else "--no-peer-pull"]) for pulls in (True, False)}
    try:
        assert wait_for(lambda: all(p.is_ready() for p in proxies.values()), timeout_s=60), "a proxy never started"
        yield {"prefills": (a, b), "decode": decode, "proxies": proxies, "tiered": tiered}
    finally:
        stop_all(*proxies.values(), a, b, decode, tiered, *started)


@pytest.fixture(scope="module")
def workers(cluster):
    return cluster["prefills"]


def complete(worker: Worker, prompt: list[int], headers: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = httpx.post(worker.url + "/v1/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return response.json()


def hint_for(worker: Worker, num_tokens: int, port: int = 0) -> dict:
    hint = PeerHint(host="127.0.0.1", port=port or worker.internal_port, num_tokens=num_tokens)
    return {PEER_HINT_HEADER: hint.to_header()}


def computed(worker: Worker) -> float:
    return metric_sum(worker.url, "pdserve_engine_computed_prompt_tokens_total")


def test_a_prefix_held_by_a_peer_is_pulled_not_computed(workers):
    a, b = workers
    complete(a, PREFIX, AUTH)
    longer = PREFIX + [300 + i for i in range(3 * BLOCK)]
    before = computed(b)
    answer = complete(b, longer, {**AUTH, **hint_for(a, len(PREFIX))})
    num_pulled = 7 * BLOCK  # A's full blocks of the prefix
    assert computed(b) - before == len(longer) - num_pulled
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") == num_pulled
    assert metric_sum(b.url, "pdserve_kv_prefix_cache_hits_by_medium_tokens_total", medium="peer") == num_pulled
    assert wait_for(lambda: metric_sum(a.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10), \
        "A still holds the peer's pin"
    assert metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total") == num_pulled
    reference = complete(a, longer, AUTH)  # A computes the new part over its own cached prefix
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    # B now holds the pulled blocks as its own: the same prompt again computes only its last token.
    again_before = computed(b)
    complete(b, longer, AUTH)
    assert computed(b) - again_before == len(longer) - (len(longer) - 1) // BLOCK * BLOCK
    # B measured both prices the measured decision uses: its prefill steps and its landed pull.
    seeds = {"compute": DEFAULT_COMPUTE_S_PER_TOKEN, "pull": DEFAULT_PULL_S_PER_TOKEN}
    for path, seed in seeds.items():
        assert 0 < metric_sum(b.url, "pdserve_kv_peer_pull_token_cost_seconds", path=path) != seed


def test_a_conversations_answer_is_pulled_from_the_decode_worker_that_decoded_it(cluster):
    """P from D: turn 1 runs through A and the decode worker D; turn 2 (turn 1's prompt, its answer and
    more) goes to B with a hint naming D. D alone holds the answer's KV: B reads the prompt's and the
    answer's full blocks from D, computes only the new part, answers as B from scratch does, and D ends
    with nothing pinned. (On a decode worker that lends nothing, the pin is a 404: B computes it all.)"""
    a, b = cluster["prefills"]
    decode = cluster["decode"]
    prompt = [170 + (i * 23) % 820 for i in range(5 * BLOCK + 1)]
    # The answer's ids must be known exactly (the next turn's prompt repeats them): a bias makes it one token.
    body = {"prompt": prompt, "max_tokens": 3 * BLOCK, "temperature": 0, "logit_bias": {"300": 100}}
    _, turn_1 = two_legs(a, decode, "/v1/completions", body, "turn-1-through-p-and-d", AUTH)
    turn_1.raise_for_status()
    assert turn_1.json()["usage"]["completion_tokens"] == 3 * BLOCK
    turn_2 = prompt + [300] * (3 * BLOCK) + [700 + i for i in range(2 * BLOCK)]
    num_held = (len(prompt) + 3 * BLOCK - 1) // BLOCK * BLOCK  # the last answer token was sampled, never computed
    lent_before = metric_sum(decode.url, "pdserve_kv_peer_pinned_tokens_total", medium="device")
    pulled_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled")
    before = computed(b)
    answer = complete(b, turn_2, {**AUTH, **hint_for(decode, num_held)})
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before == num_held
    assert computed(b) - before == len(turn_2) - num_held  # only the new user text
    assert metric_sum(decode.url, "pdserve_kv_peer_pinned_tokens_total", medium="device") - lent_before == num_held
    assert wait_for(lambda: metric_sum(decode.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10), \
        "D still holds the peer's pin"
    reset_prefix_cache(b, AUTH)
    before = computed(b)
    scratch = complete(b, turn_2, AUTH)
    assert computed(b) - before == len(turn_2)
    assert answer["choices"][0]["text"] == scratch["choices"][0]["text"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory, device):
    """A prefill worker paging 32-token blocks (the others page 16)."""
    logs = tmp_path_factory.mktemp("logs-wide")
    worker = Worker("prefill", free_port(), str(logs / "wide.log"),
                    ["--num-blocks", "100", "--internal-token", TOKEN, "--block-size", str(2 * BLOCK), *PULL_EVERY_HINT],
                    device)
    started = start_workers(worker)
    try:
        yield worker
    finally:
        stop_all(worker, *started)


def test_a_puller_of_another_block_size_reads_the_prefix_in_units_of_the_smaller(workers, wide):
    a, _ = workers
    prefix = [250 + (i * 41) % 800 for i in range(7 * BLOCK + 5)]
    complete(a, prefix, AUTH)
    longer = prefix + [400 + i for i in range(3 * BLOCK)]
    before = computed(wide)
    answer = complete(wide, longer, {**AUTH, **hint_for(a, len(prefix))})
    num_pulled = len(prefix) // (2 * BLOCK) * 2 * BLOCK  # the puller asks whole blocks of its own size
    assert computed(wide) - before == len(longer) - num_pulled
    assert metric_sum(wide.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") == num_pulled
    assert answer["choices"][0]["text"] == complete(a, longer, AUTH)["choices"][0]["text"]
    assert wait_for(lambda: metric_sum(a.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10)


def test_a_dead_or_unauthenticated_hint_costs_only_a_recompute(workers):
    a, b = workers
    prompt = [150 + (i * 11) % 700 for i in range(6 * BLOCK + 3)]
    complete(a, prompt, AUTH)
    reference = complete(a, prompt, AUTH)
    failed_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="failed")
    before = computed(b)
    dead = complete(b, prompt, {**AUTH, **hint_for(a, len(prompt), port=free_port())})
    assert dead["choices"][0]["text"] == reference["choices"][0]["text"]
    assert computed(b) - before == len(prompt)
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="failed") - failed_before == 6 * BLOCK
    # Without the token the hint is ignored: nothing is asked of A (the prompt is cached on B by now).
    pinned_before = metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total")
    other = prompt[:-1] + [999]
    unauthenticated = complete(b, other, hint_for(a, len(other)))
    assert unauthenticated["usage"]["prompt_tokens"] == len(other)
    assert metric_sum(a.url, "pdserve_kv_peer_pinned_tokens_total") == pinned_before


def test_a_prefix_held_only_in_a_peers_offload_tier_is_loaded_there_and_pulled(cluster):
    """Issue 39's acceptance: the holder's pool is too small to keep the prefix, so a second prompt evicts it
    into the holder's tier; the holder loads it back into its pool before pinning it, and the puller reads it."""
    _, b = cluster["prefills"]
    tiered = cluster["tiered"]
    prefix = [260 + (i * 43) % 850 for i in range(7 * BLOCK + 5)]  # 7 full blocks, 8 with its answer
    evicting = [110 + (i * 29) % 900 for i in range(15 * BLOCK - 8)]  # with its 8 answer tokens: all 15 blocks
    complete(tiered, prefix, AUTH)
    complete(tiered, evicting, AUTH)
    assert metric_sum(tiered.url, "pdserve_kv_offload_bytes_total", direction="store") > 0
    longer = prefix + [320 + i for i in range(3 * BLOCK)]
    before = computed(b)
    pulled_before = metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled")
    hint = PeerHint(host="127.0.0.1", port=tiered.internal_port, num_tokens=7 * BLOCK, medium="offload")
    answer = complete(b, longer, {**AUTH, PEER_HINT_HEADER: hint.to_header()})
    assert computed(b) - before == len(longer) - 7 * BLOCK
    assert metric_sum(b.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before == 7 * BLOCK
    # Every pinned block came from the holder's tier: none of the prefix was left in its pool.
    assert metric_sum(tiered.url, "pdserve_kv_peer_pinned_tokens_total", medium="offload") == 7 * BLOCK
    assert metric_sum(tiered.url, "pdserve_kv_peer_pinned_tokens_total", medium="device") == 0
    assert wait_for(lambda: metric_sum(tiered.url, "pdserve_transfer_pinned_blocks") == 0, timeout_s=10), \
        "the holder still holds the peer's pin"
    reset_prefix_cache(tiered, AUTH)  # the holder's own answer, computed from scratch
    assert answer["choices"][0]["text"] == complete(tiered, longer, AUTH)["choices"][0]["text"]


def held_by_prefill(proxy: ProxyProcess, prompt: list[int]) -> int:
    """The most prompt tokens the proxy's index predicts one prefill worker holds (0: not ready yet)."""
    try:
        answer = httpx.post(proxy.url + "/internal/routing/explain", json={"prompt": prompt}, headers=AUTH,
                            timeout=10).json()
    except httpx.HTTPError:
        return 0
    return max((c["cached_tokens"] for c in answer.get("prefill", {}).get("candidates", [])), default=0)


def run_conversations(proxy: ProxyProcess, cluster: dict, hints: bool) -> tuple[list[str], float, float]:
    """Five conversations of three turns, interleaved, through `proxy` from empty caches: the answers,
    the prompt tokens the prefill workers computed, and those pulled from a peer. With `hints`, each later
    turn waits until the proxy's index heard of the last turn's blocks (so the hint is certain)."""
    for worker in (*cluster["prefills"], cluster["decode"]):
        reset_prefix_cache(worker, AUTH)
    prefills = cluster["prefills"]
    computed_before = sum(computed(w) for w in prefills)
    pulled_before = sum(metric_sum(w.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") for w in prefills)
    prompts = [[100 + 300 * c + (i * 7) % 250 for i in range(100)] for c in range(NUM_CHATS)]
    answers = []
    for turn in range(3):
        for conversation, prompt in enumerate(prompts):
            if turn:
                prompt += [600 + 50 * conversation + 10 * turn + i for i in range(40)]
                held = (len(prompt) - 40) // BLOCK * BLOCK  # the last turn's full blocks
                assert not hints or wait_for(lambda: held_by_prefill(proxy, prompt) >= held, timeout_s=10), \
                    "the proxy's index never heard of the last turn's blocks"
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            response = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
    computed_after = sum(computed(w) for w in prefills)
    pulled_after = sum(metric_sum(w.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") for w in prefills)
    return answers, computed_after - computed_before, pulled_after - pulled_before


NUM_CHATS = 5  # odd: round robin over two workers sends each conversation's next turn to the other worker


def test_round_robin_with_peer_pulls_computes_the_one_worker_optimum(cluster):
    """Issue 39's acceptance: five interleaved chats, at most 1.25x the one-worker optimum (here: exactly it)."""
    proxies = cluster["proxies"]
    without_answers, without_computed, without_pulled = run_conversations(proxies[False], cluster, hints=False)
    answers, computed_tokens, pulled = run_conversations(proxies[True], cluster, hints=True)
    # One worker holding every history computes each turn's prompt past its previous turn's full blocks.
    optimum = NUM_CHATS * (100 + (140 - 96) + (180 - 128))
    assert computed_tokens <= 1.25 * optimum
    assert computed_tokens == optimum and pulled == NUM_CHATS * (96 + 128)
    assert without_computed > 1.5 * optimum and without_pulled == 0  # every later turn on the other worker
    assert answers == without_answers
    assert proxies[True].metric("pdserve_proxy_peer_hints_total") == 2 * NUM_CHATS


class PinRelay:
    """An HTTP relay in front of a holder's internal port, for the hint to name instead of it. Armed with
    `on_pin`, it calls that once the holder answered a pin and before the puller reads the answer: the
    holder then dies (or starts draining) between its pin and the puller's READ, whatever the machine's
    speed."""

    def __init__(self, holder: Worker):
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._relay(None)

            def do_POST(self):
                self._relay(self.rfile.read(int(self.headers.get("content-length", 0))))

            def _relay(self, body):
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-pdserve-internal-token")}
                answer = httpx.request(self.command, holder.internal_url + self.path, content=body, headers=headers,
                                       timeout=30)
                if relay.on_pin is not None and self.path == PEER_PIN_PATH and answer.status_code == 200:
                    relay.on_pin()
                    relay.on_pin, relay.fired = None, True
                self.send_response(answer.status_code)
                self.send_header("content-type", answer.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args):
                pass

        self.on_pin: Optional[Callable[[], None]] = None
        self.fired = False
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pull_with_holder_fate(holder: Worker, puller: Worker, fate: Callable[[], None], seed: int) -> dict:
    """`holder` computes a prompt; `puller` gets it and more with a hint naming `holder` through a relay
    that calls `fate` between the holder's pin and the puller's READ. The relayed path is warmed first
    (handshake and connection through the relay's address), so the armed pull goes straight from its pin
    to its READ. Returns the reference answer, the puller's answer and its counters' deltas."""
    warm = [120 + (i * 13 + seed) % 600 for i in range(4 * 2 * BLOCK + 2)]
    doomed = [130 + (i * 17 + seed) % 650 for i in range(6 * BLOCK + 7)]
    longer = doomed + [500 + i for i in range(2 * BLOCK)]
    complete(holder, warm, AUTH)
    reference = complete(holder, longer, AUTH)["choices"][0]["text"]  # the holder keeps `doomed`'s blocks
    relay = PinRelay(holder)
    try:
        pulled_before = metric_sum(puller.url, "pdserve_kv_peer_pull_tokens_total", result="pulled")
        complete(puller, warm + [700, 701], {**AUTH, **hint_for(holder, len(warm), port=relay.port)})
        assert metric_sum(puller.url, "pdserve_kv_peer_pull_tokens_total", result="pulled") - pulled_before == 8 * BLOCK
        relay.on_pin = fate
        before = {result: metric_sum(puller.url, "pdserve_kv_peer_pull_tokens_total", result=result)
                  for result in ("pulled", "failed")}
        computed_before = computed(puller)
        answer = complete(puller, longer, {**AUTH, **hint_for(holder, len(doomed), port=relay.port)})
    finally:
        relay.close()
    assert relay.fired
    return {"reference": reference, "answer": answer["choices"][0]["text"], "prompt": longer,
            "computed": computed(puller) - computed_before,
            **{result: metric_sum(puller.url, "pdserve_kv_peer_pull_tokens_total", result=result) - count
               for result, count in before.items()}}


def assert_idle(worker: Worker) -> None:
    load = httpx.get(worker.url + "/load", timeout=5).json()
    assert load["num_waiting_for_kv"] == 0 and load["num_running"] == 0 and load["num_pinned_blocks"] == 0, load


def test_a_holder_drained_between_its_pin_and_the_read_lends_the_prefix_then_exits(workers, wide):
    """Runs after the test that uses `wide` (a 32-token-block holder here, never reached by B before: see
    `doomed`): its drain (SIGTERM) starts after it pinned; a draining worker takes no request but lets its pins be read, and exits once
    nothing is pinned."""
    _, b = workers
    outcome = pull_with_holder_fate(wide, b, lambda: wide.process.send_signal(signal.SIGTERM), seed=3)
    assert outcome["answer"] == outcome["reference"]
    assert outcome["pulled"] == 6 * BLOCK and outcome["failed"] == 0  # `doomed`'s three whole 32-token blocks
    assert outcome["computed"] == len(outcome["prompt"]) - 6 * BLOCK
    wide.process.wait(Worker.stop_wait_s)  # drained: nothing left pinned for the peer
    assert "no block pinned" in open(wide.log_path).read()
    assert_idle(b)


@pytest.fixture(scope="module")
def doomed(tmp_path_factory, device):
    """A prefill worker to kill. Not A: B reached A by its own address before, and a second connection
    to the same agent under the relay's address is refused (one address per peer agent)."""
    logs = tmp_path_factory.mktemp("logs-doomed")
    worker = Worker("prefill", free_port(), str(logs / "doomed.log"),
                    ["--num-blocks", "100", "--internal-token", TOKEN, *PULL_EVERY_HINT], device)
    started = start_workers(worker)
    try:
        yield worker
    finally:
        stop_all(worker, *started)


def test_a_holder_killed_between_its_pin_and_the_read_costs_only_a_recompute(workers, doomed):
    """The puller's READ meets a dead peer (NIXL_ERR_REMOTE_DISCONNECT): counted failed, the prompt
    computed, the same answer, nothing left waiting or pinned on the puller."""
    _, b = workers
    outcome = pull_with_holder_fate(doomed, b, doomed.kill, seed=0)  # SIGKILL and wait: gone before B hears
    assert doomed.process.poll() is not None
    assert outcome["answer"] == outcome["reference"]
    assert outcome["computed"] == len(outcome["prompt"]) and outcome["pulled"] == 0
    assert outcome["failed"] == 6 * BLOCK
    assert_idle(b)
    assert complete(b, outcome["prompt"], AUTH)["choices"][0]["text"] == outcome["reference"]  # B serves on
