"""One request's trip through the engine, as the HTTP layer sees it.

`GenerationStream` wraps the engine's output stream and owns the request's
cleanup: whatever way the HTTP exchange ends, `aclose()` runs once, closes the
engine stream (which aborts an unfinished request and releases its id) and
records the request's metrics. Engine-side failures come out as the typed
`PdserveError`s the engine attached to the final output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Optional, TypeVar

import anyio
from starlette.requests import Request

from pdserve.api.errors import EngineFailure, PdserveError
from pdserve.api.kv_transfer import RemotePrefillParams
from pdserve.api.protocol import PromptTokensDetails, UsageInfo
from pdserve.api.sampling import FinishReason, TopLogprobs
from pdserve.request import GenerationRequest, RequestOutput
from pdserve.server.context import ServingContext
from pdserve.server.errors import ClientDisconnected, RequestAbortedByEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")


class GenerationStream:
    """Async iterator over one request's `RequestOutput`s, ending after the final one."""

    def __init__(self, ctx: ServingContext, request: GenerationRequest, arrival_s: float):
        self.request = request
        self._ctx = ctx
        self._arrival_s = arrival_s
        self._last_token_s: Optional[float] = None
        self._num_generated_tokens = 0
        self._finished = False
        self._closed = False
        self._outputs = ctx.engine.generate(request)

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            output = await self._outputs.__anext__()
        except StopAsyncIteration:
            self._finish("error")
            raise EngineFailure("the engine ended the request without a final output") from None
        except PdserveError:
            self._finish("error")
            raise
        self._record_tokens(output)
        if output.finished:
            self._finish_with(output)
        return output

    async def aclose(self) -> None:
        """Idempotent. Before the final output this aborts the engine request."""
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._finish("abort")
        # Shielded: this often runs inside a cancelled scope (client gone), and
        # the abort must still reach the engine.
        with anyio.CancelScope(shield=True):
            await self._outputs.aclose()

    def _record_tokens(self, output: RequestOutput) -> None:
        num_new = len(output.new_token_ids)
        if num_new == 0:
            return
        now = time.monotonic()
        metrics = self._ctx.metrics.request
        if self._last_token_s is None:
            metrics.observe_first_token(now - self._arrival_s, self.request.request_id)
        else:
            metrics.observe_inter_token(now - self._last_token_s)
        self._last_token_s = now
        self._num_generated_tokens += num_new

    def _finish_with(self, output: RequestOutput) -> None:
        reason = output.finish_reason
        if reason is FinishReason.ERROR:
            self._finish("error")
            raise output.error or EngineFailure("the engine failed to serve the request")
        if reason is FinishReason.ABORT:
            self._finish("abort")
            raise RequestAbortedByEngine("the server aborted the request; retry later")
        self._finish(reason.value if reason is not None else FinishReason.STOP.value)

    def _finish(self, reason: str) -> None:
        if self._finished:
            return
        self._finished = True
        e2e_s = time.monotonic() - self._arrival_s
        num_prompt_tokens = len(self.request.prompt_token_ids)
        self._ctx.metrics.request.observe_finished(reason, e2e_s, num_prompt_tokens, self._num_generated_tokens,
                                                   self.request.request_id)
        logger.debug(
            "request %s ended (%s): %d prompt + %d generated tokens in %.3f s",
            self.request.request_id, reason, num_prompt_tokens, self._num_generated_tokens, e2e_s,
        )


@dataclass(slots=True)
class GenerationResult:
    """Everything a non-streaming answer needs, accumulated from the outputs."""

    num_prompt_tokens: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: Optional[tuple[Optional[TopLogprobs], ...]] = None
    finish_reason: Optional[FinishReason] = None
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[RemotePrefillParams] = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, output: RequestOutput) -> None:
        self.text_parts.append(output.new_text)
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.top_logprobs.extend(output.new_top_logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.finish_reason = output.finish_reason
            self.kv_transfer_params = output.kv_transfer_params


def usage_info(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise `ClientDisconnected`).

    The request body must have been read already: afterwards the only message
    the server can receive is the disconnect.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [task for task in (work_task, watcher) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()
