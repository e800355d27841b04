"""What the HTTP layer may ask of an engine: the async face of the engine loop.

The server depends on this protocol only, so it can be tested against a fake
engine and the engine can change behind it.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol

from pdserve.engine.request_ids import RequestIdRegistry
from pdserve.models.tokenizer import Tokenizer
from pdserve.request import GenerationRequest, LoadReport, RequestOutput


class OutputStream(Protocol):
    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


class GrammarVocabulary(Protocol):
    """The model's vocabulary as the grammar engine reads it (`pdserve.runner.grammar_matchers.GrammarTokenizer`)."""

    def get(self) -> Any:
        """Built at first use (about a second: the HTTP edge calls it off the event loop);
        `GrammarTokenizerUnavailable` when this model's tokenizer cannot serve grammars."""
        ...


class EngineClient(Protocol):
    model_name: str  # the id served in /v1/models and checked against `model`
    max_model_len: int  # prompt + generated tokens may not exceed it
    tokenizer: Tokenizer
    grammar_tokenizer: Optional[GrammarVocabulary]  # None: grammars are not checked up front at the edge
    request_ids: RequestIdRegistry  # shared with the engine loop: reserve before `generate`

    def is_ready(self) -> bool:
        """False while weights load, while draining, or once the engine stopped."""
        ...

    def is_alive(self) -> bool:
        """False once the worker cannot serve any more (engine loop dead, load failed)."""
        ...

    def progress_age_s(self) -> float:
        """Seconds since the engine loop last completed an iteration."""
        ...

    def generate(self, request: GenerationRequest) -> OutputStream:
        """Submit a request and iterate its outputs; the last one has finished=True.

        From this call on the engine owns `request.request_id` (reserved in
        `request_ids`) and releases it; if the call raises, the caller does.
        Closing the stream early (client disconnect) aborts the request and
        frees its blocks. Iterating raises `EngineOverloaded` when the queue is
        full, and the P/D admission's typed errors.
        """
        ...

    async def abort(self, request_id: str) -> None:
        ...

    def load_report(self) -> LoadReport:
        """A cheap snapshot for routing decisions (may be a step stale)."""
        ...
