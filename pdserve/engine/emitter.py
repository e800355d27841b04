"""Hands each request's outputs to its sink, on the engine thread.

Invariant: every request registered here gets exactly one final output
(finished=True), whatever way it ends: a stop rule, a stop string, an abort,
an error in its own processing, or the death of the engine loop. A sink that
raises is dropped, never allowed to reach the engine loop.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from pdserve.api.errors import PdserveError
from pdserve.api.sampling import FinishReason
from pdserve.engine.outputs import OutputProcessor
from pdserve.engine.schedule_types import SampledToken
from pdserve.request import Request, RequestOutput

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


class OutputEmitter:
    def __init__(self, processor: OutputProcessor):
        self.processor = processor
        self._sinks: dict[str, OutputSink] = {}

    def register(self, request_id: str, sink: OutputSink) -> None:
        self._sinks[request_id] = sink

    def request_ids(self) -> list[str]:
        return list(self._sinks)

    def emit(self, request: Request, token: Optional[SampledToken]) -> Optional[FinishReason]:
        """Send the tokens `request` gained this step. Returns STOP when a stop
        string ended it (the caller then finishes it in the scheduler)."""
        output, stop_reason = self.processor.process(request, token)
        self._send(request.request_id, output)
        return stop_reason

    def emit_final(self, request: Request) -> None:
        """Final output of a request that ended outside the normal token path (abort, error)."""
        self.processor.forget(request.request_id)
        self._send(request.request_id, RequestOutput(
            request.request_id, (), "", finished=True, finish_reason=request.finish_reason, error=request.error,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=len(request.output_token_ids),
            kv_transfer_params=request.kv_transfer_params,
        ))

    def fail(self, request_id: str, error: PdserveError) -> None:
        """End a request whose engine state is already gone (its final output failed to build)."""
        self.processor.forget(request_id)
        self._send(request_id, RequestOutput(request_id, (), "", finished=True, finish_reason=FinishReason.ERROR,
                                             error=error))

    def fail_all(self, error: PdserveError) -> None:
        for request_id in self.request_ids():
            self.fail(request_id, error)

    def _send(self, request_id: str, output: RequestOutput) -> None:
        sink = self._sinks.pop(request_id, None) if output.finished else self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink(output)
        except Exception:
            logger.exception("request %s: its output sink failed; dropping it", request_id)
            self._sinks.pop(request_id, None)
