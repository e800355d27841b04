"""Proxy overhead benchmark: the latency `pdserve proxy` adds and its request rate, against the same
requests sent straight to the backend, over stub workers that answer at once. Four paths over HTTP/1.1
keep-alive on 127.0.0.1: direct; proxy (1 leg); proxy (P/D, the two-leg protocol); proxy (P/D,
kv_aware: each request templated, tokenized and matched against the stubs' KV event snapshots).

Invariant: every path gets the same bodies from the same minimal client, and the stubs (a raw ASGI
app in its own process) do no work, so the differences are the proxy's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

from bench.lib.launch import REPO_ROOT, ServerProcess, free_port, metric_sum
from bench.lib.machine import machine_info, process_cpu_s
from bench.lib.report import cell, markdown_table, write_document
from bench.lib.stats import percentile

KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "stub-p",
             "remote_request_id": "r", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1",
             "remote_port": 1, "tp_size": 1}
PREFILL_ANSWER = json.dumps({"id": "cmpl-p", "object": "text_completion", "choices": [
    {"index": 0, "text": " x", "finish_reason": "length"}], "kv_transfer_params": KV_PARAMS}).encode()
COMPLETION_ANSWER = json.dumps({"id": "cmpl-d", "object": "text_completion", "model": "stub", "choices": [
    {"index": 0, "text": " hello there", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}}).encode()
SSE_ANSWER = b"".join(b"data: " + json.dumps({"id": "cmpl-d", "choices": [
    {"index": 0, "text": t, "finish_reason": None}]}).encode() + b"\n\n" for t in (" hello", " there")) + b"data: [DONE]\n\n"
LOAD_ANSWER = json.dumps({"ready": True, "num_running": 0, "num_waiting": 0, "num_waiting_for_kv": 0,
                          "kv_usage": 0.0, "num_pinned_blocks": 0}).encode()
BODY = json.dumps({"model": "stub", "prompt": "Once upon a time in a small village by the sea", "max_tokens": 2,
                   "temperature": 0}).encode()
STREAM_BODY = json.dumps({**json.loads(BODY), "stream": True}).encode()


def _sixth_turn() -> list[dict]:
    """A conversation in its sixth turn (about 330 prompt tokens), as kv_aware routing sees most requests."""
    messages = [{"role": "system", "content": "You are a patient science teacher. Answer in two short sentences."}]
    for turn in range(6):
        messages += [{"role": "user", "content": f"Question {turn}: why do volcanoes erupt, and how often?"},
                     {"role": "assistant", "content": "Pressure from gas-rich magma builds up until the rock "
                                                      "above gives way; some erupt yearly, others rarely."}]
    return messages[:-1]


CHAT_BODY = json.dumps({"model": "stub", "messages": _sixth_turn(), "max_tokens": 2, "temperature": 0}).encode()
KINDS = (("completion", "/v1/completions", BODY), ("stream", "/v1/completions", STREAM_BODY),
         ("chat (6 turns)", "/v1/chat/completions", CHAT_BODY))
PATHS = ("direct", "proxy (1 leg)", "proxy (P/D)", "proxy (P/D, kv_aware)")
KV_PATH = PATHS[3]
TARGET_ADDED_P50_MS = 1.0


def make_stub_app(kv: Optional[dict] = None):
    """A worker that answers instantly: prefill params, a completion, or an SSE stream; with `kv`
    (from `kv_stub_data`) it also serves routing info and a KV event stream holding every prompt."""

    async def stub_app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        if kv is not None and scope["path"] == "/internal/kv/events":
            await _stream_events(kv, receive, send)
            return
        content_type = b"application/json"
        if scope["path"] in ("/load", "/health"):
            payload = LOAD_ANSWER
        elif kv is not None and scope["path"] == "/internal/kv/routing_info":
            payload = kv["routing_info"].encode()
        else:
            request = json.loads(body)
            if (request.get("kv_transfer_params") or {}).get("do_remote_decode"):
                payload = PREFILL_ANSWER
            elif request.get("stream"):
                payload, content_type = SSE_ANSWER, b"text/event-stream"
            else:
                payload = COMPLETION_ANSWER
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    return stub_app


async def _stream_events(kv: dict, receive, send) -> None:
    """The snapshot, then a heartbeat a second, until the proxy hangs up."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})
    await send({"type": "http.response.body", "body": kv["snapshot"].encode(), "more_body": True})
    hung_up = asyncio.ensure_future(receive())  # the body was read: the next message is the disconnect
    try:
        while not hung_up.done():
            await asyncio.wait({hung_up}, timeout=1.0)
            if not hung_up.done():
                await send({"type": "http.response.body", "body": kv["heartbeat"].encode(), "more_body": True})
    finally:
        hung_up.cancel()


def kv_stub_data() -> dict:
    """Routing info of the embedded SmolLM2 and a snapshot holding the block hashes of every benchmark
    prompt, computed the way a worker computes them (the stubs themselves import nothing)."""
    from pdserve.kv.events import CachedBlock, KVSnapshot
    from pdserve.kv.events_wire import encode_heartbeat, encode_snapshot
    from pdserve.kv.hashing import HASH_SCHEME, hash_full_blocks
    from pdserve.kv.routing_info import GroupInfo, RoutingInfo
    from pdserve.models.gguf_file import GGUFCheckpoint
    from pdserve.models.loader import embedded_model_path
    from pdserve.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_vocab(GGUFCheckpoint(embedded_model_path()).vocab())
    prompts = [tokenizer.encode(json.loads(BODY)["prompt"]),
               tokenizer.encode(tokenizer.apply_chat_template(json.loads(CHAT_BODY)["messages"]), False)]
    blocks = [CachedBlock(h, None, 0) for ids in prompts for h in hash_full_blocks(ids, 16, [])]
    info = RoutingInfo(model="stub", epoch="bench", hash_scheme=HASH_SCHEME, block_size=16, prefix_caching=True,
                       groups=[GroupInfo(kind="full")], tokenizer_json=tokenizer.backend.to_str(),
                       chat_template=tokenizer.chat_template, bos_token=tokenizer.bos_token,
                       eos_token=tokenizer.eos_token)
    return {"routing_info": info.model_dump_json(), "snapshot": encode_snapshot("bench", KVSnapshot(0, tuple(blocks)), 16)
            .decode(), "heartbeat": encode_heartbeat("bench", 0).decode()}


class RawClient:
    """The leanest HTTP/1.1 keep-alive client asyncio allows, so the client costs little and the same everywhere."""

    def __init__(self, port: int):
        self._port = port
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self._port)
        self._writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            return status, await self._reader.readexactly(int(headers["content-length"]))
        return status, await self._read_chunked()

    async def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append((await self._reader.readexactly(size + 2))[:-2])  # the chunk and its CRLF
            if size == 0:
                return b"".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


async def measure_latency(targets: dict[str, tuple[int, Optional[int]]], path: str, body: bytes, num_requests: int,
                          num_warmup: int, num_rounds: int) -> dict[str, dict]:
    """Sequential requests, the paths interleaved in rounds so that load drifting on the machine
    hits every path alike; also the proxy's CPU time per request, which scheduling noise cannot inflate."""
    clients = {name: RawClient(port) for name, (port, _) in targets.items()}
    samples: dict[str, list[float]] = {name: [] for name in targets}
    cpu_s = {name: 0.0 for name in targets}
    per_round = max(1, num_requests // num_rounds)
    try:
        for name, client in clients.items():
            for _ in range(num_warmup):
                await client.post(path, body)
        for _ in range(num_rounds):
            for name, (port, pid) in targets.items():
                cpu_before_s = process_cpu_s(pid) if pid is not None else 0.0
                for _ in range(per_round):
                    started = time.perf_counter()
                    status, _ = await clients[name].post(path, body)
                    if status != 200:
                        raise RuntimeError(f"HTTP {status} from {name}")
                    samples[name].append(time.perf_counter() - started)
                if pid is not None:
                    cpu_s[name] += process_cpu_s(pid) - cpu_before_s
    finally:
        for client in clients.values():
            client.close()
    results = {}
    for name, (_, pid) in targets.items():
        results[name] = {"p50_ms": 1000 * percentile(samples[name], 50), "p99_ms": 1000 * percentile(samples[name], 99),
                         "mean_ms": 1000 * statistics.fmean(samples[name])}
        if pid is not None:
            results[name]["proxy_cpu_ms_per_request"] = 1000 * cpu_s[name] / len(samples[name])
    return results


async def measure_rate(port: int, concurrency: int, duration_s: float) -> float:
    deadline = time.perf_counter() + duration_s
    counts = [0] * concurrency

    async def worker(slot: int) -> None:
        client = RawClient(port)
        try:
            while time.perf_counter() < deadline:
                status, _ = await client.post("/v1/completions", BODY)
                counts[slot] += status == 200
        finally:
            client.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
    return sum(counts) / (time.perf_counter() - started)


def overhead_from_metrics(port: int) -> dict:
    """The proxy's own view: the share of requests whose overhead fell in the <= 0.5, 1, 2.5 ms buckets."""
    def count(le: str) -> float:
        url = f"http://127.0.0.1:{port}"
        return metric_sum(url, "pdserve_proxy_overhead_seconds_bucket", mode="disaggregated", le=le)

    total = count("+Inf")
    return {f"share_le_{le}s": count(le) / total for le in ("0.0005", "0.001", "0.0025")} if total else {}


async def wait_kv_ready(port: int, timeout_s: float = 60.0) -> None:
    """The kv_aware proxy has the tokenizer and both stubs' snapshots: the chat prompt is fully cached."""
    deadline = time.monotonic() + timeout_s
    client = RawClient(port)
    try:
        while time.monotonic() < deadline:
            status, body = await client.post("/internal/routing/explain", CHAT_BODY)
            answer = json.loads(body) if status == 200 else {}
            candidates = [c for role in ("prefill", "decode") for c in (answer.get(role) or {}).get("candidates", [])]
            if len(candidates) == 2 and all(c["cached_tokens"] > 0 for c in candidates):
                return
            await asyncio.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError("the kv_aware proxy never indexed the stubs' blocks")


async def run(args: argparse.Namespace, kv_file: str, log_dir: str) -> dict:
    ports = {name: free_port() for name in ("prefill", "decode", "proxy_pd", "proxy_1leg", "proxy_kv")}
    stub = [sys.executable, "-m", "bench.proxy", "--kv-file", kv_file, "--serve-stub"]
    proxy = [sys.executable, "-m", "pdserve.app.cli", "proxy", "--log-level", "warning",
             "--decode", f"127.0.0.1:{ports['decode']}"]
    two_legs = ["--prefill", f"127.0.0.1:{ports['prefill']}"]
    argvs = {
        "prefill": [*stub, str(ports["prefill"])], "decode": [*stub, str(ports["decode"])],
        "proxy_pd": [*proxy, "--port", str(ports["proxy_pd"]), *two_legs],
        "proxy_1leg": [*proxy, "--port", str(ports["proxy_1leg"])],
        # Both legs every time (no cache-aware skip), so it compares with the plain P/D path.
        "proxy_kv": [*proxy, "--port", str(ports["proxy_kv"]), *two_legs, "--policy", "kv_aware",
                     "--kv-decode-only-max-tokens", "0"],
    }
    processes = {name: ServerProcess(name, argv, ports[name], os.path.join(log_dir, f"{name}.log"), ready="health")
                 for name, argv in argvs.items()}
    try:
        for process in processes.values():
            process.start()
        for process in processes.values():
            process.wait_ready(30.0)
        await wait_kv_ready(ports["proxy_kv"])
        pid = {name: process.process.pid for name, process in processes.items()}
        targets = dict(zip(PATHS, ((ports["decode"], None), (ports["proxy_1leg"], pid["proxy_1leg"]),
                                   (ports["proxy_pd"], pid["proxy_pd"]), (ports["proxy_kv"], pid["proxy_kv"]))))
        results: dict[str, dict] = {name: {} for name in PATHS}
        for kind, path, body in KINDS:
            for name, measured in (await measure_latency(targets, path, body, args.requests, args.warmup,
                                                         args.rounds)).items():
                results[name][kind] = measured
        for name, (port, _) in targets.items():
            results[name]["max_requests_per_s"] = await measure_rate(port, args.concurrency, args.duration_s)
        for name, port in (("proxy (P/D)", ports["proxy_pd"]), (KV_PATH, ports["proxy_kv"])):
            results[name]["proxy_overhead_histogram"] = overhead_from_metrics(port)
        return results
    finally:
        for process in reversed(processes.values()):  # the proxies first: they hold the stubs' event streams
            process.stop(timeout_s=10)


def report(results: dict, args: argparse.Namespace) -> dict:
    direct = results["direct"]
    rows = []
    for name in PATHS:
        for kind, _, _ in KINDS:
            r, d = results[name][kind], direct[kind]
            rate = results[name]["max_requests_per_s"] if kind == "completion" else None
            rows.append({"path": name, "kind": kind, **r, "added_p50_ms": r["p50_ms"] - d["p50_ms"],
                         "added_p99_ms": r["p99_ms"] - d["p99_ms"], "max_requests_per_s": rate})
    print(markdown_table(["path", "kind", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "proxy CPU ms/req", "max req/s"], [
        (r["path"], r["kind"], *(cell(r.get(k), ".3f") for k in ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms",
                                                                 "proxy_cpu_ms_per_request")),
         cell(r["max_requests_per_s"], ".0f")) for r in rows]))
    overhead = {name: results[name].get("proxy_overhead_histogram", {}) for name in ("proxy (P/D)", KV_PATH)}
    one_leg_added = results["proxy (1 leg)"]["completion"]["p50_ms"] - direct["completion"]["p50_ms"]
    kv_share = overhead[KV_PATH].get("share_le_0.001s", 0.0)
    kv_added = {kind: results[KV_PATH][kind]["p50_ms"] - results["proxy (P/D)"][kind]["p50_ms"] for kind, _, _ in KINDS}
    print(f"proxy's own overhead histogram: {overhead}")
    print(f"target: < {TARGET_ADDED_P50_MS} ms added at p50 by forwarding (1 leg): "
          f"{'met' if one_leg_added < TARGET_ADDED_P50_MS else 'NOT met'} ({one_leg_added:.3f} ms)")
    print(f"target: kv_aware proxy overhead < {TARGET_ADDED_P50_MS} ms at p50: "
          f"{'met' if kv_share >= 0.5 else 'NOT met'} ({kv_share:.0%} of requests at <= 1 ms); "
          f"kv_aware adds {', '.join(f'{k} {v:+.3f} ms' for k, v in kv_added.items())} at p50 over plain P/D")
    return {"benchmark": "proxy", "machine": machine_info(),
            "settings": {"requests": args.requests, "warmup": args.warmup, "rounds": args.rounds,
                         "concurrency": args.concurrency,
                         "duration_s": args.duration_s},
            "rows": rows, "proxy_overhead_histogram": overhead, "kv_aware_added_p50_ms": kv_added,
            "target_added_p50_ms": TARGET_ADDED_P50_MS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per latency measurement")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10, help="latency runs interleave the paths in this many rounds")
    parser.add_argument("--concurrency", type=int, default=32, help="connections for the max-rate measurement")
    parser.add_argument("--duration-s", type=float, default=8.0, help="length of each max-rate measurement")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "proxy.json"))
    parser.add_argument("--serve-stub", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--kv-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub is not None:
        import uvicorn

        kv = None
        if args.kv_file:
            with open(args.kv_file) as f:
                kv = json.load(f)
        # Keep-alive past a whole round of the other paths: the direct client reuses its connection.
        uvicorn.run(make_stub_app(kv), host="127.0.0.1", port=args.serve_stub, log_level="warning", access_log=False,
                    timeout_keep_alive=120)
        return 0
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as work_dir:
        kv_file = os.path.join(work_dir, "kv.json")
        with open(kv_file, "w") as f:
            json.dump(kv_stub_data(), f)
        summary = report(asyncio.run(run(args, kv_file, work_dir)), args)
    write_document(args.out, summary, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
