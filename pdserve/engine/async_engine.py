"""The async face of the engine loop (implements `EngineClient`).

Invariants: every request submitted is either finished by the engine or
aborted when its consumer stops iterating, so a vanished client never strands
blocks; a request id reserved for a request is released exactly once (by the
stream if the request never reached the engine, else by the engine loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional

from pdserve.api.errors import EngineNotReady, EngineOverloaded
from pdserve.api.kv_transfer import AwaitedPrefillParams
from pdserve.engine.api import GrammarVocabulary
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.models.tokenizer import Tokenizer
from pdserve.pd.admission import KVAdmission, LocalAdmission
from pdserve.request import GenerationRequest, LoadReport, RequestOutput

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs. Submits on the first `__anext__`; `aclose` aborts an unfinished request."""

    def __init__(self, engine: "AsyncEngine", request: GenerationRequest):
        self._engine = engine
        self.request = request
        self._outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._submitted = False
        self._finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        if not self._submitted:
            await self._submit()
        output = await self._outputs.get()
        self._finished = output.finished
        return output

    async def _submit(self) -> None:
        engine = self._engine
        engine.check_can_accept()
        awaited = self.request.kv_params
        if engine.reserves_before_ticket and isinstance(awaited, AwaitedPrefillParams):
            await self._submit_before_ticket(awaited.awaited_ticket)
            return
        self.request = await engine.admission.admit(self.request)
        engine.check_can_accept()  # admission awaits: the world may have changed
        self._hand_over(self.request)

    async def _submit_before_ticket(self, key: str) -> None:
        """D, a decode leg sent beside its prefill leg: the engine reserves the prompt's blocks while
        admission waits for P's ticket and claims it; the ticket then goes to the engine thread. If
        admission fails or is cancelled (P failed, the wait ran out, the leg closed) the reservation is
        aborted at once and the error is this call's, as when admission came first."""
        engine = self._engine
        self._hand_over(dataclasses.replace(self.request, kv_params=None, awaited_ticket=key))
        try:
            admitted = await engine.admission.admit(self.request)
        except BaseException:
            self._finished = True  # nothing more comes out of this stream; aclose need not abort again
            engine.engine_loop.abort(self.request.request_id)
            raise
        engine.engine_loop.deliver_ticket(key, admitted)

    def _hand_over(self, request: GenerationRequest) -> None:
        engine = self._engine
        event_loop = asyncio.get_running_loop()
        sink = lambda output: event_loop.call_soon_threadsafe(self._outputs.put_nowait, output)  # noqa: E731
        engine.engine_loop.submit(request, sink)
        engine.num_in_flight += 1
        self._submitted = True  # from here on the engine loop owns the request id

    async def aclose(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._submitted:
            self._engine.request_ids.release(self.request.request_id)
            return
        self._engine.num_in_flight -= 1
        if not self._finished:
            self._engine.engine_loop.abort(self.request.request_id)


class AsyncEngine:
    def __init__(self, loop: EngineLoop, model_name: str, max_model_len: int, tokenizer: Tokenizer,
                 max_in_flight: int, admission: Optional[KVAdmission] = None,
                 grammar_tokenizer: Optional[GrammarVocabulary] = None, reserves_before_ticket: bool = False):
        """`reserves_before_ticket`: D with a ticket inbox; a decode leg that awaits P's ticket enters the
        engine (which reserves its blocks) before the ticket comes, not after."""
        self.reserves_before_ticket = reserves_before_ticket
        self.engine_loop = loop
        self.admission: KVAdmission = admission or LocalAdmission()
        self.request_ids: RequestIdRegistry = loop.request_ids
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.draining = False
        self.grammar_tokenizer = grammar_tokenizer

    def is_ready(self) -> bool:
        return not self.draining and self.is_alive()

    def is_alive(self) -> bool:
        return self.engine_loop.is_alive()

    def check_can_accept(self) -> None:
        if not self.is_alive():
            raise EngineNotReady("the engine has stopped; this worker is restarting")
        if self.draining:
            raise EngineNotReady("this worker is draining; send the request to another one")
        if self.num_in_flight >= self.max_in_flight:
            raise EngineOverloaded(f"too many requests in flight ({self.num_in_flight}); retry later")

    # ---- drain (see pdserve/app/drain.py) ------------------------------------------------

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

    def generate(self, request: GenerationRequest) -> RequestStream:
        """From this call on the engine owns `request.request_id` (a reserved id)."""
        return RequestStream(self, request)

    def load_report(self) -> LoadReport:
        # Read from the HTTP thread without locks: plain ints, a step stale at worst.
        return self.engine_loop.load_report()

    def progress_age_s(self) -> float:
        return self.engine_loop.progress_age_s()

    async def abort(self, request_id: str) -> None:
        """Callers abort by closing `generate`'s stream; this is for ids seen in outputs."""
        self.engine_loop.abort(request_id)


class LoadingEngine:
    """Stands in for the engine while weights load, so /health can say 503."""

    def __init__(self, model_name: str, request_ids: RequestIdRegistry):
        self._model_name = model_name
        self.request_ids = request_ids
        self.inner: Optional[AsyncEngine] = None
        self.load_error: Optional[str] = None

    def is_ready(self) -> bool:
        return self.inner is not None and self.inner.is_ready()

    def is_alive(self) -> bool:
        """Alive while loading; afterwards as long as the engine loop runs."""
        if self.load_error is not None:
            return False
        return self.inner is None or self.inner.is_alive()

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

    @property
    def grammar_tokenizer(self) -> Optional[GrammarVocabulary]:
        return self._engine().grammar_tokenizer

    def generate(self, request: GenerationRequest) -> RequestStream:
        return self._engine().generate(request)  # raising leaves the id with the caller

    async def abort(self, request_id: str) -> None:
        await self._engine().abort(request_id)

    def load_report(self) -> LoadReport:
        return self.inner.load_report() if self.inner is not None else LoadReport()

    def progress_age_s(self) -> float:
        return self.inner.progress_age_s() if self.inner is not None else 0.0
