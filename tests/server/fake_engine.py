"""A deterministic stand-in for the engine behind `EngineClient`, for testing the HTTP layer.

`FakeEngine` replies with scripted text, one token per output, honouring
max_tokens and stop_token_ids; it records every request it was given and
every request that was aborted (iterator closed or cancelled before the final
output). `FakeTokenizer` maps UTF-8 bytes to ids so encode/decode round-trip.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI

from pdserve.api.config import LimitsConfig, ServerConfig
from pdserve.api.errors import EngineFailure, PdserveError
from pdserve.api.kv_transfer import RemotePrefillParams
from pdserve.api.sampling import FinishReason
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.metrics import Metrics, create_metrics
from pdserve.request import GenerationRequest, LoadReport, RequestOutput
from pdserve.server.app import create_app

BOS_ID = 1
EOS_ID = 2
_BYTE_OFFSET = 3  # ids 0..2 are special: pad, BOS, EOS


class FakeTokenizer:
    """Byte-level: id = byte + 3, BOS=1, EOS=2; vocabulary of 259 ids."""

    vocab_size = 256 + _BYTE_OFFSET
    eos_token_ids = (EOS_ID,)
    chat_template = None  # its own fixed format below, no Jinja template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [byte + _BYTE_OFFSET for byte in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i - _BYTE_OFFSET for i in ids if i >= _BYTE_OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> str:
        if any(m["role"] == "assistant" and m["content"] == "RAISE" for m in messages):
            raise ValueError("conversation roles must alternate")  # like a strict Jinja template
        text = "<s>" + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeEngine:
    reply: str = "Hello world"
    model_name: str = "fake-model"
    max_model_len: int = 128
    ready: bool = True
    token_delay_s: float = 0.0
    stall_after_tokens: Optional[int] = None  # stop producing (forever) after this many tokens
    raise_on_start: Optional[PdserveError] = None  # raised from the first iteration
    error_after_tokens: Optional[int] = None  # then a FinishReason.ERROR output
    error_message: str = "KV transfer failed"
    crash_after_tokens: Optional[int] = None  # then raise a RuntimeError: a bug below the HTTP layer
    kv_transfer_params_out: Optional[RemotePrefillParams] = None  # attached to the final output
    num_cached_tokens: int = 0
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    grammar_tokenizer: None = None  # grammars are compiled but not checked against a vocabulary
    requests: list[GenerationRequest] = field(default_factory=list)
    aborted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)

    request_ids: RequestIdRegistry = field(default_factory=RequestIdRegistry)
    alive: bool = True

    def is_ready(self) -> bool:
        return self.ready and self.alive

    def is_alive(self) -> bool:
        return self.alive

    def progress_age_s(self) -> float:
        return 0.0

    def load_report(self) -> LoadReport:
        return LoadReport()

    def generate(self, request: GenerationRequest) -> "_FakeStream":
        return _FakeStream(self, request)

    async def abort(self, request_id: str) -> None:
        if request_id not in self.aborted_ids and request_id not in self.finished_ids:
            self.aborted_ids.append(request_id)

    def reply_token_ids(self, request: GenerationRequest) -> tuple[list[int], FinishReason]:
        """The tokens this request will get and why it stops."""
        token_ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        for index, token_id in enumerate(token_ids):
            if token_id in request.sampling.stop_token_ids:
                return token_ids[: index + 1], FinishReason.STOP
        if len(token_ids) > request.sampling.max_tokens:
            return token_ids[: request.sampling.max_tokens], FinishReason.LENGTH
        return token_ids, FinishReason.STOP

    async def _run(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        done = False
        try:
            if self.raise_on_start is not None:
                done = True
                raise self.raise_on_start
            token_ids, reason = self.reply_token_ids(request)
            for index, token_id in enumerate(token_ids):
                await self._pace(index)
                if self.crash_after_tokens is not None and index == self.crash_after_tokens:
                    raise RuntimeError("a bug below the HTTP layer")
                if self.error_after_tokens is not None and index == self.error_after_tokens:
                    done = True
                    yield self._output(request, (), index, FinishReason.ERROR)
                    return
                final = index == len(token_ids) - 1
                # Mark done before the final yield: closing the iterator after it is no abort.
                done = final
                yield self._output(request, (token_id,), index + 1, reason if final else None)
        finally:
            if done:
                self.finished_ids.append(request.request_id)
            else:
                self.aborted_ids.append(request.request_id)
            self.request_ids.release(request.request_id)  # like the engine loop, once the request is gone

    async def _pace(self, index: int) -> None:
        if self.stall_after_tokens is not None and index >= self.stall_after_tokens:
            await asyncio.Event().wait()  # never set: only cancellation or close gets us out
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)

    def _output(
        self, request: GenerationRequest, new_ids: tuple[int, ...], num_output: int, reason: Optional[FinishReason]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=self.tokenizer.decode(list(new_ids)),
            new_logprobs=tuple(-0.25 for _ in new_ids) if request.sampling.logprobs else (),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=num_output,
            num_cached_tokens=self.num_cached_tokens,
            error=EngineFailure(self.error_message) if reason is FinishReason.ERROR else None,
            kv_transfer_params=self.kv_transfer_params_out if reason is not None else None,
        )


class _FakeStream:
    """The engine's stream contract: the id is released once, also when iteration never started."""

    def __init__(self, engine: FakeEngine, request: GenerationRequest):
        self._engine = engine
        self._request = request
        self._run: Optional[AsyncIterator[RequestOutput]] = None

    def __aiter__(self) -> "_FakeStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._run is None:
            self._run = self._engine._run(self._request)
        return await self._run.__anext__()

    async def aclose(self) -> None:
        if self._run is None:
            self._run = self._engine._run(self._request)  # never started: nothing ran, nothing to abort
            self._engine.request_ids.release(self._request.request_id)
            return
        await self._run.aclose()


# ------------------------------------------------------------- test helpers


def make_app(engine: FakeEngine, metrics: Optional[Metrics] = None, *, server: Optional[ServerConfig] = None,
             limits: Optional[LimitsConfig] = None) -> FastAPI:
    """The real app around a fake engine."""
    return create_app(engine, metrics if metrics is not None else create_metrics(), server or ServerConfig(),
                      limits=limits or LimitsConfig())


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pdserve.test")


def sse_payloads(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded, with the final "[DONE]" kept as a string."""
    payloads = []
    for event in text.split("\n\n"):
        if not event.strip():
            continue
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
