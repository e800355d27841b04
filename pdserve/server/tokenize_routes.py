"""`POST /tokenize` and `POST /detokenize`: the served model's tokenizer, so clients can count tokens.

Invariant: the ids /tokenize returns are exactly the prompt the generation
routes would build from the same input (same template, same special tokens).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.api.errors import InvalidRequest
from pdserve.api.http_bounds import read_body
from pdserve.api.tokenize_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pdserve.server.context import ServingContext
from pdserve.server.openai_routes import json_response, parse_body
from pdserve.server.preprocess import check_model, check_token_ids, ensure_ready, tokenize_chat


def build_tokenize_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        body = parse_body(TokenizeRequest, await read_body(raw, ctx.limits), ctx.limits)
        ensure_ready(ctx.engine)
        check_model(ctx.engine, body.model)
        tokenizer = ctx.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        # Tokenizing, one decode per token for the strings, and the JSON of a long prompt all take
        # milliseconds: off the event loop, where every other request's stream waits.
        def answer() -> Response:
            if body.messages is not None:
                token_ids = tokenize_chat(tokenizer, body)
            else:
                token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            strings = [tokenizer.decode([token_id]) for token_id in token_ids] if body.return_token_strs else None
            return json_response(TokenizeResponse(count=len(token_ids), max_model_len=ctx.engine.max_model_len,
                                                  tokens=list(token_ids), token_strs=strings))

        return await asyncio.to_thread(answer)

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        body = parse_body(DetokenizeRequest, await read_body(raw, ctx.limits), ctx.limits)
        ensure_ready(ctx.engine)
        check_model(ctx.engine, body.model)
        check_token_ids(body.tokens, ctx.engine.tokenizer.vocab_size, "tokens")
        text = await asyncio.to_thread(ctx.engine.tokenizer.decode, body.tokens)
        return json_response(DetokenizeResponse(prompt=text))

    return router
