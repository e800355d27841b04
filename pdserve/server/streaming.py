"""Server-sent events for streamed answers: one `data: {json}` event per chunk,
an optional usage chunk, then `data: [DONE]`.

Invariant: however the stream ends (finished, engine error, client gone, or
never started at all), the request's `ChoiceStreams` is closed exactly once,
so every unfinished engine request is aborted and every request id freed.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable, Mapping, Optional

import anyio
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.api.errors import PdserveError
from pdserve.metrics import RequestMetrics
from pdserve.request import RequestOutput
from pdserve.server.choices import ChoiceStreams
from pdserve.server.errors import body_for_exception, error_response_body
from pdserve.server.formatting import ResponseFormat
from pdserve.server.generation import usage_info

logger = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


class _SendTimedOut(Exception):
    """The client took no part of an event within the send timeout."""


class EventStreamResponse(StreamingResponse):
    """A `StreamingResponse` that always runs its cleanup, even if its body never started, and gives
    up on a client that stops reading.

    An async generator that was never iterated skips its own `finally`, so the
    cleanup cannot live only inside the body generator. A client that does not
    take an event within `send_timeout_s` (its socket buffers full: it stopped
    reading) is dropped like a disconnected one, so it cannot hold a stream
    slot, its request or its connection for ever.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: Optional[Mapping[str, str]] = None,
        send_timeout_s: Optional[float] = None,
    ):
        super().__init__(content, headers={**_STREAM_HEADERS, **(headers or {})})
        self._content = content
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, self._bounded(send))
        except _SendTimedOut:
            logger.warning("a streamed answer's client took nothing for %g s; dropping it", self._send_timeout_s)
        except ClientDisconnect:
            # ASGI >= 2.4 servers report a gone client by failing `send`; the
            # headers are out, so there is no one left to tell: just clean up.
            logger.debug("client of a streamed answer disconnected")
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()


    def _bounded(self, send: Send) -> Send:
        if self._send_timeout_s is None:
            return send
        timeout_s = self._send_timeout_s

        async def bounded_send(message: dict) -> None:
            try:
                with anyio.fail_after(timeout_s):
                    await send(message)
            except TimeoutError:
                raise _SendTimedOut() from None

        return bounded_send


async def sse_events(
    streams: ChoiceStreams,
    first: tuple[int, RequestOutput],
    response_format: ResponseFormat,
    include_usage: bool,
    metrics: RequestMetrics,
) -> AsyncIterator[bytes]:
    """Events of one request (every choice), starting from its already-received first output."""
    num_completion_tokens = 0
    num_cached_tokens: dict[int, int] = {}  # per prompt, its leader's
    try:
        for chunk in response_format.opening_chunks():
            yield sse_event(chunk)
        item: Optional[tuple[int, RequestOutput]] = first
        while item is not None:
            index, output = item
            num_completion_tokens += len(output.new_token_ids)
            choice = streams.choices[index]
            if choice.leader is None:
                num_cached_tokens[choice.prompt_index] = output.num_cached_tokens
            for chunk in response_format.output_chunks(index, output):
                yield sse_event(chunk)
            item = await anext(streams, None)
        if include_usage:
            num_prompt_tokens = sum(len(c.request.prompt_token_ids) for c in streams.choices if c.leader is None)
            usage = usage_info(num_prompt_tokens, num_completion_tokens, sum(num_cached_tokens.values()))
            yield sse_event(response_format.usage_chunk(usage))
    except PdserveError as exc:
        # Headers are gone already: the error travels as an event the OpenAI client raises on.
        request_id = streams.choices[0].request.request_id
        logger.warning("request %s failed mid-stream (%d): %s", request_id, exc.status_code, exc.message)
        metrics.count_error(exc.status_code)
        yield sse_event(body_for_exception(exc))
    except Exception:  # noqa: BLE001 - our bug: the client still gets an ending, the log the request id
        logger.exception("request %s failed mid-stream", streams.choices[0].request.request_id)
        metrics.count_error(500)
        yield sse_event(error_response_body(500, "internal server error", "internal_error"))
    finally:
        await streams.aclose()
    yield DONE_EVENT
