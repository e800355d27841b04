"""P: the stream events of token 1, built for the proxy to send the client before D's stream starts.

A prefill leg whose `kv_transfer_params` ask for them (`want_first_events`, our proxy's, only for a
streamed client request) gets, beside its pin, the SSE events a colocated worker streams up to and
including its first output token: chat's role chunk, then token 1's chunk (text, logprobs). The proxy
writes them to the client at once and strips the same events from the head of D's stream
(proxy/early_stream.py), so D itself is unchanged and emits token 1 as always.

Invariant: the events are exactly what a *continuing* stream sends for token 1 (this worker's own
`ResponseFormat`, fed the text `continuing_first_text` gives: an incomplete UTF-8 sequence or a
possible start of a stop string held back), or there are none. None whenever token 1 could look
different in D's stream, each such case named (P's answer says which, and the proxy counts it in
`pdserve_proxy_early_first_token_total{outcome="not_offered", reason}`):

    n_choices      more than one choice (n > 1, a batch of prompts): their events interleave
    echo           completions' echo and prompt logprobs travel with the first chunk
    grammar        structured output: D recomputes token 1 under its own grammar state
    ends_at_one    token 1 ends the request (EOS, a stop token or string, max_tokens 1, context full)
    held_back      token 1 shows nothing yet (its text held back): nothing to gain
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from pdserve.api.kv_transfer import RemoteDecodeRequest
from pdserve.api.sampling import FinishReason
from pdserve.engine.outputs import continuing_first_text
from pdserve.request import GenerationRequest, RequestOutput
from pdserve.server.formatting import CompletionFormat, ResponseFormat
from pdserve.server.generation import GenerationResult

logger = logging.getLogger(__name__)

FIRST_EVENTS_FIELD = "first_events"  # in P's answer's kv_transfer_params: the events as one string
FIRST_EVENTS_SKIPPED_FIELD = "first_events_skipped"  # instead: why there are none (a name listed above)


def wants_first_events(request: GenerationRequest) -> bool:
    params = request.kv_params
    return isinstance(params, RemoteDecodeRequest) and params.want_first_events


def first_events(response_format: ResponseFormat, requests: Sequence[GenerationRequest],
                 results: Sequence[GenerationResult], tokenizer: Any, max_model_len: int,
                 *, num_choices: int, constrained: bool) -> tuple[Optional[str], Optional[str]]:
    """Token 1's stream events for P's single-choice answer and None, or None and why not (the
    module's list: the proxy counts the reason).
    `num_choices`: the client's n (P's own leg computes one choice whatever n is); `constrained`: the
    request names an output constraint (P's leg samples without it: pdserve/server/preprocess.py)."""
    why = _ineligible(response_format, requests, results, max_model_len, num_choices, constrained)
    if why is not None:
        logger.debug("request %s: no early first events (%s)", requests[0].request_id, why)
        return None, why
    request, result = requests[0], results[0]
    token_id = result.token_ids[0]
    text = continuing_first_text(tokenizer, token_id, request.sampling.stop)
    output = RequestOutput(request_id=request.request_id, new_token_ids=(token_id,), new_text=text,
                           new_logprobs=tuple(result.logprobs[:1]), new_top_logprobs=tuple(result.top_logprobs[:1]),
                           num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1)
    token_chunks = response_format.output_chunks(0, output)
    if not token_chunks:
        logger.debug("request %s: no early first events (held_back)", request.request_id)
        return None, "held_back"
    chunks = [*response_format.opening_chunks(), *token_chunks]
    return "".join("data: " + chunk.model_dump_json() + "\n\n" for chunk in chunks), None


def _ineligible(response_format: ResponseFormat, requests: Sequence[GenerationRequest],
                results: Sequence[GenerationResult], max_model_len: int, num_choices: int,
                constrained: bool) -> Optional[str]:
    if num_choices != 1 or len(requests) != 1 or len(results) != 1:
        return "n_choices"
    request, result = requests[0], results[0]
    if isinstance(response_format, CompletionFormat) and response_format.echo:
        return "echo"
    if request.sampling.prompt_logprobs is not None:
        return "echo"
    if constrained or request.sampling.grammar is not None:
        return "grammar"
    params = request.kv_params
    decode_max_tokens = params.decode_max_tokens if isinstance(params, RemoteDecodeRequest) else None
    if (len(result.token_ids) != 1 or result.finish_reason is not FinishReason.LENGTH  # P's own max_tokens 1
            or decode_max_tokens == 1 or len(request.prompt_token_ids) + 1 >= max_model_len):
        return "ends_at_one"
    return None
