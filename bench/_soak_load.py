"""The soak's requests: good ones with their baseline answers, every hostile input of issue 9, clients that
leave mid-stream; and sending them at a fixed concurrency.

Invariant: the plan depends only on its seed, and every request yields exactly one `Result` (a
transport error is a result with status 0, never an exception out of `run_plan`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

MODEL = "SmolLM2-135M-Instruct"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOPICS = ["the sea", "a dragon", "mountains", "a robot", "the moon", "bread", "a violin", "winter", "a city",
          "a garden"]


@dataclass(frozen=True)
class Call:
    kind: str  # "good", "hostile" (must get a 4xx) or "leave" (reads the start of a stream, hangs up)
    name: str
    path: str
    body: Any  # dict, or raw bytes
    headers: dict = field(default_factory=dict)


def good_calls() -> list[Call]:
    calls = []
    for index, topic in enumerate(TOPICS):
        stream = index % 2 == 1
        calls.append(Call("good", f"completion-{index}", COMPLETIONS, {
            "model": MODEL, "prompt": f"Write one sentence about {topic}.", "max_tokens": 8 + index % 5,
            "temperature": 0, "stream": stream}))
        calls.append(Call("good", f"chat-{index}", CHAT, {
            "model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": 8 + index % 5, "temperature": 0, "stream": not stream}))
    return calls


def hostile_calls() -> list[Call]:
    def body(**extra: Any) -> dict:
        return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}

    deep = b'{"prompt": "hi", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    return [Call("hostile", name, COMPLETIONS, payload, headers) for name, payload, headers in [
        ("id-256", body(), {"X-Request-Id": "x" * 256}),
        ("max-tokens-0", body(prompt="word " * 600, max_tokens=0), {}),
        ("min-over-max", body(max_tokens=2, min_tokens=3), {}),
        ("stream-options-no-stream", body(stream_options={"include_usage": True}), {}),
        ("stream-yes", body(stream="yes"), {}),
        ("deep-json", deep, {}),
        ("too-large", b'{"prompt": "' + b"x" * (9 << 20) + b'"}', {}),
        ("prompt-chars", body(prompt="x" * 1_000_001), {}),
        ("many-stops", body(stop=["s"] * 1000), {}),
        ("many-stop-ids", body(stop_token_ids=list(range(5000))), {}),
        ("nan", b'{"prompt": "hi", "temperature": NaN}', {}),
        ("n-200", body(n=200), {}),  # n itself is served since issue 11; past OpenAI's 128 is not
        ("unknown-model", body(model="gpt-9"), {}),
        ("token-out-of-vocab", body(prompt=[1, 2, 10**9]), {}),
        ("context-too-long", body(prompt="word " * 9000), {}),
    ]]


def build_plan(num_requests: int, hostile_fraction: float, seed: int) -> list[Call]:
    rng = random.Random(seed)
    goods, hostiles = good_calls(), hostile_calls()
    leave = Call("leave", "leave-mid-stream", COMPLETIONS, {
        "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 64, "ignore_eos": True, "stream": True})
    plan = []
    for _ in range(num_requests):
        if rng.random() < hostile_fraction:
            plan.append(leave if rng.random() < 0.2 else rng.choice(hostiles))
        else:
            plan.append(rng.choice(goods))
    return plan


# ---------------------------------------------------------------- sending


@dataclass
class Result:
    index: int
    kind: str
    name: str
    status: int  # 0: no answer (transport error)
    latency_s: float
    text: str = ""
    error: str = ""


def answer_text(path: str, content_type: str, raw: str) -> str:
    if content_type.startswith("text/event-stream"):
        text = ""
        for event in raw.split("\n\n"):
            if event.startswith("data: {"):
                for choice in json.loads(event[6:]).get("choices", []):
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        return text
    choice = json.loads(raw)["choices"][0]
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"]


async def send(client: httpx.AsyncClient, index: int, call: Call) -> Result:
    started = time.perf_counter()
    content = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    headers = {"content-type": "application/json", **call.headers}
    try:
        async with client.stream("POST", call.path, content=content, headers=headers) as response:
            if call.kind == "leave":
                async for _ in response.aiter_bytes():
                    break
                return Result(index, call.kind, call.name, response.status_code, time.perf_counter() - started)
            raw = (await response.aread()).decode(errors="replace")
    except httpx.HTTPError as error:
        return Result(index, call.kind, call.name, 0, time.perf_counter() - started, error=type(error).__name__)
    result = Result(index, call.kind, call.name, response.status_code, time.perf_counter() - started)
    if call.kind == "good" and response.status_code == 200:
        result.text = answer_text(call.path, response.headers.get("content-type", ""), raw)
    elif response.status_code != 200:
        result.error = raw[:200]
    return result


async def run_plan(base_url: str, plan: list[Call], concurrency: int,
                   on_done: Callable[[Result], None]) -> list[Result]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        async def one(index: int, call: Call) -> Result:
            async with gate:
                result = await send(client, index, call)
            on_done(result)
            return result

        return list(await asyncio.gather(*(one(i, call) for i, call in enumerate(plan))))
