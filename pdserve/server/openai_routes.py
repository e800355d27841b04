"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

Both generation routes share `_serve`: parse, check, tokenize, then answer as
one JSON body or as an SSE stream. Until a `GenerationStream` exists the route
owns the request id; from then on the stream does, and closing it is the only
cleanup (abort if unfinished, metrics, id release).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pdserve.config import LimitsConfig
from pdserve.errors import EngineOverloaded
from pdserve.http_bounds import read_body
from pdserve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, OpenAIRequest
from pdserve.request import GenerationRequest
from pdserve.server.context import REQUEST_ID_HEADER, ServingContext
from pdserve.server.errors import check_internal_token
from pdserve.server.formatting import ChatFormat, CompletionFormat, ResponseFormat
from pdserve.server.generation import GenerationStream, collect, run_until_disconnected
from pdserve.server.preprocess import check_model, ensure_ready, prepare_chat, prepare_completion
from pdserve.server.streaming import EventStreamResponse, sse_events
from pdserve.validation import parse_request

BodyT = TypeVar("BodyT", bound=OpenAIRequest)
Preparer = Callable[[Any, Any, str], Awaitable[GenerationRequest]]
FormatFactory = Callable[[ServingContext, Any, str], ResponseFormat]


def parse_body(schema: type[BodyT], raw_body: bytes, limits: LimitsConfig = LimitsConfig()) -> BodyT:
    """The shared edge validation (pdserve/validation.py), the same the proxy runs."""
    return parse_request(schema, raw_body, limits)


def json_response(body: BaseModel, headers: dict[str, str] | None = None, status_code: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json", headers=headers)


def _completion_format(ctx: ServingContext, body: CompletionRequest, request_id: str) -> ResponseFormat:
    return CompletionFormat(
        response_id=f"cmpl-{request_id}", model=ctx.engine.model_name, created=int(time.time()),
        tokenizer=ctx.engine.tokenizer, with_logprobs=body.wants_logprobs,
    )


def _chat_format(ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> ResponseFormat:
    return ChatFormat(
        response_id=f"chatcmpl-{request_id}", model=ctx.engine.model_name, created=int(time.time()),
        tokenizer=ctx.engine.tokenizer, with_logprobs=body.wants_logprobs,
    )


async def _serve(
    ctx: ServingContext,
    raw: Request,
    schema: type[OpenAIRequest],
    prepare: Preparer,
    make_format: FormatFactory,
) -> Response:
    arrival_s = time.monotonic()
    request_id = ctx.request_ids.reserve(raw.headers.get(REQUEST_ID_HEADER))
    raw.state.request_id = request_id  # lets the error handlers echo it
    stream: GenerationStream | None = None
    holds_stream_slot = False
    handed_off = False
    try:
        body = parse_body(schema, await read_body(raw, ctx.limits), ctx.limits)
        if body.kv_transfer_params is not None:
            # Params make a worker pin (P) or read (D) memory: internal callers only.
            check_internal_token(raw, ctx.config.internal_token)
        ensure_ready(ctx.engine)
        check_model(ctx.engine, body.model)
        if body.stream:
            holds_stream_slot = _take_stream_slot(ctx)
        generation_request = await prepare(ctx.engine, body, request_id)
        response_format = make_format(ctx, body, request_id)
        stream = GenerationStream(ctx, generation_request, arrival_s)
        headers = {REQUEST_ID_HEADER: request_id}
        if body.stream:
            # Wait for the first output before sending headers, so that a request
            # the engine refuses (overloaded, bad kv_transfer_params) still gets
            # its proper HTTP status instead of a 200 with an error event.
            first = await run_until_disconnected(raw, stream.__anext__())
            events = sse_events(stream, first, response_format, body.include_usage, ctx.metrics.request)
            handed_off = True
            return EventStreamResponse(events, on_close=_StreamCloser(ctx, stream), headers=headers)
        result = await run_until_disconnected(raw, collect(stream))
        return json_response(response_format.final_response(result), headers)
    finally:
        if not handed_off:
            if holds_stream_slot:
                ctx.num_open_streams -= 1
            if stream is not None:
                await stream.aclose()
            else:
                ctx.request_ids.release(request_id)


def _take_stream_slot(ctx: ServingContext) -> bool:
    """Reserve one of the worker's concurrent streams, or refuse before any work (503)."""
    if ctx.num_open_streams >= ctx.config.max_concurrent_streams:
        raise EngineOverloaded(f"{ctx.num_open_streams} streamed answers are open, the most this worker serves; "
                               "retry later")
    ctx.num_open_streams += 1
    return True


@dataclass(slots=True)
class _StreamCloser:
    """Closes a streamed answer's engine stream and gives its slot back (the slot once, however often called)."""

    ctx: ServingContext
    stream: GenerationStream
    holds_slot: bool = True

    async def __call__(self) -> None:
        if self.holds_slot:
            self.holds_slot = False
            self.ctx.num_open_streams -= 1
        await self.stream.aclose()


def build_openai_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        return await _serve(ctx, raw, CompletionRequest, prepare_completion, _completion_format)

    @router.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        return await _serve(ctx, raw, ChatCompletionRequest, prepare_chat, _chat_format)

    @router.get("/v1/models")
    async def list_models() -> Response:
        card = ModelCard(id=ctx.engine.model_name, created=ctx.created_s, max_model_len=ctx.engine.max_model_len)
        return json_response(ModelList(data=[card]))

    return router
