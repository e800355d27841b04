"""The proxy's two hops of the P/D wire protocol, sent by hand to a prefill and a decode worker
(tests and the chaos benchmark catch a request between them).

Invariant: the legs are spelled exactly as the proxy spells them (docs/protocol.md).
"""

from __future__ import annotations

import time
from typing import Optional

import httpx

from bench.lib.launch import Worker


REMOTE_DECODE = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def prefill_leg(prefill: Worker, path: str, body: dict, request_id: str, headers: Optional[dict] = None) -> httpx.Response:
    """The proxy's first hop, as the wire protocol describes it."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    params = dict(REMOTE_DECODE)  # the decode leg's limits travel as the proxy sends them (P keeps min_tokens <= 1)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["decode_max_tokens"] = max_tokens
    if body.get("min_tokens"):
        params["decode_min_tokens"] = body["min_tokens"]
    leg.update(stream=False, max_tokens=1, kv_transfer_params=params)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return httpx.post(prefill.url + path, json=leg, headers={"X-Request-Id": request_id, **(headers or {})}, timeout=120)


def decode_leg(decode: Worker, path: str, body: dict, params: dict, request_id: str,
               headers: Optional[dict] = None) -> httpx.Response:
    return httpx.post(decode.url + path, json={**body, "kv_transfer_params": params},
                      headers={"X-Request-Id": request_id, **(headers or {})}, timeout=120)


def two_legs(prefill: Worker, decode: Worker, path: str, body: dict, request_id: str,
             headers: Optional[dict] = None) -> tuple[dict, httpx.Response]:
    first = prefill_leg(prefill, path, body, request_id, headers)
    first.raise_for_status()
    params = first.json()["kv_transfer_params"]
    return params, decode_leg(decode, path, body, params, request_id, headers)


def page_bytes(worker: Worker, headers: Optional[dict] = None, restart_wait_s: float = 60.0) -> int:
    """Bytes of one page of a P or D worker's pool (one rank's, for a tensor-parallel worker).

    The handshake answers 503 while the worker's NIXL agent process restarts (one that died is
    replaced; pdserve/transfer/nixl_transport.py): the pool's geometry does not change, so this
    waits up to `restart_wait_s` for the new agent."""
    deadline = time.monotonic() + restart_wait_s
    while True:
        answer = httpx.get(worker.internal_url + "/internal/kv/agent_info", headers=headers or {}, timeout=10)
        if answer.status_code != 503 or time.monotonic() > deadline:
            answer.raise_for_status()
            return int(answer.json()["geometry"]["page_bytes"])
        time.sleep(0.2)
