"""What the HTTP layer may ask of an engine: the async face of the engine loop.

The server depends on this protocol only, so it can be tested against a fake
engine and the engine can change behind it.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from pdserve.models.tokenizer import Tokenizer
from pdserve.request import GenerationRequest, LoadReport, RequestOutput


class EngineClient(Protocol):
    model_name: str  # the id served in /v1/models and checked against `model`
    max_model_len: int  # prompt + generated tokens may not exceed it
    tokenizer: Tokenizer

    def is_ready(self) -> bool:
        """False while weights load or the engine is draining."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate its outputs; the last one has finished=True.

        Closing the iterator early (client disconnect) aborts the request and
        frees its blocks. Raises `EngineOverloaded` when the queue is full.
        """
        ...

    async def abort(self, request_id: str) -> None:
        ...

    def load_report(self) -> LoadReport:
        """A cheap snapshot for routing decisions (may be a step stale)."""
        ...
