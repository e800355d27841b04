"""The async face of the engine loop (implements `EngineClient`).

Invariant: every request submitted is either finished by the engine or aborted
when its consumer stops iterating, so a vanished client never strands blocks.
"""

from __future__ import annotations

import asyncio
import logging
import dataclasses
import itertools
from typing import AsyncIterator, Optional, Protocol

from pdserve.engine.loop import EngineLoop
from pdserve.errors import EngineNotReady, EngineOverloaded
from pdserve.models.tokenizer import Tokenizer
from pdserve.request import GenerationRequest, LoadReport, RequestOutput

logger = logging.getLogger(__name__)


class RequestFrontend(Protocol):
    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Validate and complete a request on the async side (may raise a typed 4xx)."""
        ...


class AsyncEngine:
    def __init__(self, loop: EngineLoop, model_name: str, max_model_len: int, tokenizer: Tokenizer,
                 max_in_flight: int, frontend: Optional[RequestFrontend] = None):
        self.engine_loop = loop
        self.frontend = frontend
        # Engine-side ids are unique for the life of the process even when a
        # caller reuses an id (a prefill's blocks stay pinned under its id).
        self._sequence = itertools.count()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.draining = False

    def is_ready(self) -> bool:
        return not self.draining

    # ---- drain (see pdserve/drain.py) ------------------------------------------------

    def start_drain(self) -> None:
        self.draining = True

    def is_drained(self) -> bool:
        load = self.load_report()
        return self.num_in_flight == 0 and load.num_pinned_blocks == 0 and not (
            load.num_running or load.num_waiting or load.num_waiting_for_kv
        )

    def abort_all(self) -> None:
        self.engine_loop.abort_all()

    def start(self) -> None:
        self.engine_loop.start()

    def shutdown(self) -> None:
        self.engine_loop.shutdown()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self.draining:
            raise EngineNotReady("this worker is draining; send the request to another one")
        if self.num_in_flight >= self.max_in_flight:
            raise EngineOverloaded(f"too many requests in flight ({self.num_in_flight}); retry later")
        if self.frontend is not None:
            request = await self.frontend.prepare(request)
        request = dataclasses.replace(request, request_id=f"{request.request_id}.{next(self._sequence)}")
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        self.num_in_flight += 1
        self.engine_loop.submit(request, lambda output: event_loop.call_soon_threadsafe(outputs.put_nowait, output))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            self.num_in_flight -= 1
            if not finished:
                self.engine_loop.abort(request.request_id)

    def load_report(self) -> LoadReport:
        # Read from the HTTP thread without locks: plain ints, a step stale at worst.
        return self.engine_loop.load_report()

    async def abort(self, request_id: str) -> None:
        """Callers abort by closing `generate`'s iterator; ids given here are
        engine-side ids as seen in outputs."""
        self.engine_loop.abort(request_id)


class LoadingEngine:
    """Stands in for the engine while weights load, so /health can say 503."""

    def __init__(self, model_name: str):
        self._model_name = model_name
        self.inner: Optional[AsyncEngine] = None
        self.load_error: Optional[str] = None

    def is_ready(self) -> bool:
        return self.inner is not None and self.inner.is_ready()

    def _engine(self) -> AsyncEngine:
        if self.inner is None:
            raise EngineNotReady(self.load_error or "the model is still loading")
        return self.inner

    @property
    def model_name(self) -> str:
        return self.inner.model_name if self.inner is not None else self._model_name

    @property
    def max_model_len(self) -> int:
        return self._engine().max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine().tokenizer

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self._engine().generate(request)

    async def abort(self, request_id: str) -> None:
        await self._engine().abort(request_id)

    def load_report(self) -> LoadReport:
        return self.inner.load_report() if self.inner is not None else LoadReport()
