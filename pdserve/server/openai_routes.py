"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

Both generation routes share `_serve`: parse, check, tokenize, fan out into
choices (pdserve/server/choices.py), then answer as one JSON body or as an SSE
stream. Until a `ChoiceStreams` exists the route owns the request id; from
then on it does, and closing it is the only cleanup (abort unfinished
choices, metrics, id release).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import EngineOverloaded
from pdserve.api.http_bounds import read_body
from pdserve.api.kv_transfer import KV_RECOMPUTED_HEADER
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, OpenAIRequest
from pdserve.api.validation import parse_request
from pdserve.server.chat_formatting import ChatFormat, ToolMode
from pdserve.server.choices import ChoiceStreams, plan_choices
from pdserve.server.context import REQUEST_ID_HEADER, ServingContext
from pdserve.server.errors import check_internal_token
from pdserve.server.peer_routes import peer_hint_from
from pdserve.server.first_events import (FIRST_EVENTS_FIELD, FIRST_EVENTS_SKIPPED_FIELD, first_events,
                                         wants_first_events)
from pdserve.server.formatting import CompletionFormat, ResponseFormat, results_usage
from pdserve.server.generation import GenerationResult, run_until_disconnected
from pdserve.server.preprocess import PreparedRequest, check_model, ensure_ready, prepare_chat, prepare_completion
from pdserve.server.streaming import EventStreamResponse, sse_events
from pdserve.tools.parsers import parser_for_template

BodyT = TypeVar("BodyT", bound=BaseModel)
Preparer = Callable[[Any, Any, LimitsConfig], Awaitable[PreparedRequest]]
FormatFactory = Callable[[ServingContext, Any, str, PreparedRequest], ResponseFormat]


def parse_body(schema: type[BodyT], raw_body: bytes, limits: LimitsConfig = LimitsConfig()) -> BodyT:
    """The shared edge validation (pdserve/api/validation.py), the same the proxy runs."""
    return parse_request(schema, raw_body, limits)


def json_response(body: BaseModel, headers: dict[str, str] | None = None, status_code: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json", headers=headers)


# Answers carrying more entries than this (tokens, logprobs, alternatives) are built on a worker
# thread: formatting tens of thousands of logprobs takes milliseconds, and on the event loop every
# other request's stream would wait for it.
OFF_LOOP_ENTRIES = 4096


def answer_size(results: Sequence[GenerationResult]) -> int:
    """Entries a final answer formats: tokens, their alternatives, prompt logprobs and theirs."""
    size = 0
    for result in results:
        size += len(result.token_ids) + sum(len(top) for top in result.top_logprobs)
        size += sum(1 + len(top) for top in result.prompt_logprobs or () if top is not None)
    return size


async def final_json_response(build: Callable[[], BaseModel], size: int, headers: dict[str, str]) -> Response:
    """`json_response(build())`, off the event loop when the answer is large."""
    if size <= OFF_LOOP_ENTRIES:
        return json_response(build(), headers)
    return await asyncio.to_thread(lambda: json_response(build(), headers))


def _completion_format(ctx: ServingContext, body: CompletionRequest, request_id: str,
                       prepared: PreparedRequest) -> ResponseFormat:
    prompts = body.prompt_inputs()
    texts = tuple(p if isinstance(p, str) else ctx.engine.tokenizer.decode(list(p)) for p in prompts) \
        if body.echo else ()
    return CompletionFormat(
        response_id=f"cmpl-{request_id}", model=ctx.engine.model_name, created=int(time.time()),
        tokenizer=ctx.engine.tokenizer, with_logprobs=body.wants_logprobs, num_top_logprobs=body.top_logprobs_count,
        echo=bool(body.echo), prompts=prepared.prompts, prompt_texts=texts, num_choices=prepared.num_choices,
    )


def _chat_format(ctx: ServingContext, body: ChatCompletionRequest, request_id: str,
                 prepared: PreparedRequest) -> ResponseFormat:
    mode = body.tool_choice_mode
    tools = ToolMode(
        kind=mode,
        function_name=body.tool_choice.function.name if mode == "named" else "",  # type: ignore[union-attr]
        parser=parser_for_template(ctx.engine.tokenizer.chat_template) if mode == "auto" else None,
    )
    return ChatFormat(
        response_id=f"chatcmpl-{request_id}", model=ctx.engine.model_name, created=int(time.time()),
        tokenizer=ctx.engine.tokenizer, with_logprobs=body.wants_logprobs, num_top_logprobs=body.top_logprobs_count,
        num_choices=prepared.num_choices, tools=tools,
    )


async def _collect(streams: ChoiceStreams) -> list[GenerationResult]:
    results = [GenerationResult(num_prompt_tokens=len(c.request.prompt_token_ids)) for c in streams.choices]
    async for index, output in streams:
        results[index].add(output)
    return results


def _mark_recomputed(headers: dict[str, str], streams: ChoiceStreams) -> None:
    """D tells the proxy that a P/D leg's prompt was computed here (the proxy counts such legs)."""
    if streams.pd_recomputed:
        headers[KV_RECOMPUTED_HEADER] = "1"


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
    streams: ChoiceStreams | None = None
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
        prepared = await prepare(ctx.engine, body, ctx.limits)
        response_format = make_format(ctx, body, request_id, prepared)
        hint = peer_hint_from(raw, ctx.config.internal_token)
        streams = ChoiceStreams(ctx, plan_choices(prepared, request_id, ctx.request_ids, hint), arrival_s)
        headers = {REQUEST_ID_HEADER: request_id}
        if body.stream:
            # Wait for the first output before sending headers, so that a request
            # the engine refuses (overloaded, bad kv_transfer_params) still gets
            # its proper HTTP status instead of a 200 with an error event.
            first = await run_until_disconnected(raw, streams.__anext__())
            _mark_recomputed(headers, streams)
            events = sse_events(streams, first, response_format, body.include_usage, ctx.metrics.request)
            handed_off = True
            return EventStreamResponse(events, on_close=_StreamCloser(ctx, streams), headers=headers,
                                       send_timeout_s=ctx.config.stream_send_timeout_s)
        results = await run_until_disconnected(raw, _collect(streams))
        _mark_recomputed(headers, streams)
        usage = results_usage(results, [len(p) for p in prepared.prompts], prepared.num_choices)
        answered = streams

        def build() -> BaseModel:  # the answer first: token 1's events then feed the format's stream state
            answer = response_format.final_response(results, usage)
            return _with_first_events(answer, *_first_events(ctx, answered, results, response_format, body))

        return await final_json_response(build, answer_size(results), headers)
    finally:
        if not handed_off:
            if holds_stream_slot:
                ctx.num_open_streams -= 1
            if streams is not None:
                await streams.aclose()
            else:
                ctx.request_ids.release(request_id)


def _first_events(ctx: ServingContext, streams: ChoiceStreams, results: Sequence[GenerationResult],
                  response_format: ResponseFormat, body: OpenAIRequest) -> tuple[Optional[str], Optional[str]]:
    """P: token 1's stream events when our proxy's prefill leg asks (pdserve/server/first_events.py)."""
    requests = [choice.request for choice in streams.choices]
    if not requests or not wants_first_events(requests[0]):
        return None, None
    return first_events(response_format, requests, results, ctx.engine.tokenizer, ctx.engine.max_model_len,
                        num_choices=body.num_choices, constrained=body.output_constraint() is not None)


def _with_first_events(answer: BaseModel, events: Optional[str], skipped: Optional[str]) -> BaseModel:
    params = getattr(answer, "kv_transfer_params", None)
    if isinstance(params, dict):
        if events is not None:
            params[FIRST_EVENTS_FIELD] = events
        elif skipped is not None:
            params[FIRST_EVENTS_SKIPPED_FIELD] = skipped
    return answer


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
    streams: ChoiceStreams
    holds_slot: bool = True

    async def __call__(self) -> None:
        if self.holds_slot:
            self.holds_slot = False
            self.ctx.num_open_streams -= 1
        await self.streams.aclose()


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
