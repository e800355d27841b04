"""Starts real pdserve worker processes on 127.0.0.1 for integration tests."""

from __future__ import annotations

import os
from typing import Optional

import httpx

from bench.lib.launch import ProxyProcess, Worker, free_port, start_workers, stop_all, wait_for  # noqa: F401 (re-exported)
from bench.lib.legs import REMOTE_DECODE, decode_leg, page_bytes, prefill_leg, two_legs  # noqa: F401 (re-exported)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reset_prefix_cache(worker: Worker, headers: Optional[dict] = None) -> None:
    """Drops every cached prefix block of `worker` (its internal listener's route), so that a test on a worker
    other tests shared starts from an empty prefix cache whatever ran before it."""
    response = httpx.post(worker.internal_url + "/internal/kv/reset_prefix_cache", headers=headers, timeout=30)
    response.raise_for_status()


def same_path_reference(worker: Worker, path: str, body: dict, request_id: str, headers: Optional[dict] = None,
                        block_size: int = 16) -> dict:
    """What a P/D answer must equal bit for bit (tokens and logprobs), on any device and dtype.

    `worker` (the prefill worker, prefix caching on) answers `body` twice by itself. The
    prompt ends one token past a block boundary, so the second time every prompt token
    but the last is a prefix-cache hit and the last one is computed as a single-token
    step over cached KV. A P/D leg that follows hits the same cache on P, so P samples the
    first token exactly so (protocol 7: D starts from P's token) and D decodes over the
    same KV bytes, on the same attention path and dtype. An independent run (the prompt
    as one chunk) would take another attention path, and in bf16 may round differently."""
    first = httpx.post(worker.url + path, json=body, timeout=120,
                       headers={"X-Request-Id": f"{request_id}-warm", **(headers or {})})
    first.raise_for_status()
    second = httpx.post(worker.url + path, json=body, headers={"X-Request-Id": request_id, **(headers or {})},
                        timeout=120)
    second.raise_for_status()
    answer = second.json()
    num_prompt = answer["usage"]["prompt_tokens"]
    assert (num_prompt - 1) % block_size == 0, f"a {num_prompt}-token prompt does not end one past a block"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == num_prompt - 1, answer["usage"]
    return answer
