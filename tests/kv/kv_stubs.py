"""Stub workers that also speak the KV-routing endpoints: routing info and an event stream the test drives.

A `KVStubWorker` serves a ChatML-style tokenizer and template, streams a
snapshot of the blocks it is told it holds (on its device or in its offload
tier) followed by heartbeats and any
lines the test pushes, and reports `cached_tokens` in its answers' usage.
"""

from __future__ import annotations

import asyncio
import json
import queue
from dataclasses import dataclass, field
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.kv.events import CachedBlock, KVEvent, KVSnapshot
from pdserve.kv.events_wire import encode_events, encode_heartbeat, encode_snapshot
from pdserve.kv.hashing import HASH_SCHEME
from pdserve.kv.routing_info import EVENTS_PATH, ROUTING_INFO_PATH, GroupInfo, RoutingInfo
from tests.chat_styles import STYLES, build_tokenizer
from tests.proxy.proxy_stubs import StubWorker

BLOCK = 4


def stub_routing_info(epoch: str = "e1") -> RoutingInfo:
    style = STYLES["qwen2"]
    return RoutingInfo(model="stub-model", epoch=epoch, hash_scheme=HASH_SCHEME, block_size=BLOCK,
                       prefix_caching=True, groups=[GroupInfo(kind="full")],
                       tokenizer_json=build_tokenizer(style).to_str(), chat_template=style.template,
                       bos_token=style.bos, eos_token=style.eos)


@dataclass
class KVStubWorker(StubWorker):
    epoch: str = "e1"
    held: list[bytes] = field(default_factory=list)  # block hashes of group 0 in the snapshot
    offloaded: list[bytes] = field(default_factory=list)  # and those in its host-memory offload tier
    serve_info: bool = True
    reported_cached_tokens: int = 0
    info: Optional[bytes] = None
    pushed: "queue.Queue[tuple[bytes, int]]" = field(default_factory=queue.Queue)  # (line, seq after it)
    num_streams: int = 0
    last_seq: int = 0  # where a new stream's snapshot starts

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes += [Route(ROUTING_INFO_PATH, self._info, methods=["GET"]),
                              Route(EVENTS_PATH, self._events_stream, methods=["GET"])]
        return app

    def restart(self, epoch: str, held: list[bytes]) -> None:
        """As a new process: a new epoch, other blocks, and the current stream ends."""
        self.epoch, self.held, self.last_seq = epoch, held, 0
        self.pushed.put((b"", 0))  # the empty line ends the stream

    def push_events(self, events: list[KVEvent]) -> None:
        self.pushed.put((encode_events(self.epoch, events, BLOCK), events[-1].seq))

    async def _info(self, request: Request) -> Response:
        if not self.serve_info:
            return JSONResponse({"error": {"message": "no"}}, status_code=404)
        if self.info is None:
            self.info = stub_routing_info(self.epoch).model_dump_json().encode()
        return Response(self.info, media_type="application/json")

    async def _events_stream(self, request: Request) -> Response:
        self.num_streams += 1
        return StreamingResponse(self._lines(), media_type="application/x-ndjson")

    async def _lines(self):
        sent_seq = self.last_seq
        snapshot = KVSnapshot(sent_seq, tuple(CachedBlock(h, None, 0) for h in self.held)
                              + tuple(CachedBlock(h, None, 0, "cpu") for h in self.offloaded))
        yield encode_snapshot(self.epoch, snapshot, BLOCK)
        while True:
            try:
                line, seq = self.pushed.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.02)
                yield encode_heartbeat(self.epoch, sent_seq)
                continue
            if not line:
                return
            sent_seq = seq
            yield line

    def _answer_usage(self) -> dict:
        return {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": self.reported_cached_tokens}}

    async def _generate(self, request: Request) -> Response:
        response = await super()._generate(request)
        if response.status_code != 200 or not isinstance(response, JSONResponse):
            return response
        body = json.loads(response.body)
        body["usage"] = self._answer_usage()
        return JSONResponse(body)
