"""Decode side: whether D starts a P/D request from the first token P sampled, or computes it again.

Invariant: D takes a first token only from P's own ticket (never from the client's params), and only
when continuing from it gives exactly the tokens a colocated worker would: the same draw indices
(D's first draw is the second), the same penalties and stop rules (token 1 is an ordinary output
token), the same logprobs (P's, for the alternatives the request asks). Every request that came
with a usable ticket but recomputes the first token is counted by reason. A request whose prompt D
computes after all (a failed pull, a stale lease, P's data path gone) still goes on from P's token:
D's prefill computes the prompt and token 1 and draws token 2 (engine/scheduler.py `_admit`). Torch-free.

    ticket.first_token ──▶ grammar? state model? other sampling? logprobs P lacks? ── yes ──▶ D computes
         │ no                                                                        the last prompt
         ▼                                                                           token (counted)
    D pulls the KV of all P prompt tokens; token 1 is output token 1; D's first step writes its KV
    at position P and samples token 2
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pdserve.api.kv_transfer import FirstToken, PinTicket
from pdserve.api.sampling import SamplingParams

# Why D computed the first token again (the label of pdserve_pd_first_token_recomputed_total).
# structured_output: the grammar's state starts at the prompt's end, not after token 1; recurrent_state:
# P hands over the state before the last prompt token (models with recurrent state recompute it);
# logprobs_mismatch: the request asks for alternatives P did not record; no_first_token: P's ticket
# carries none; sampling_mismatch: P drew it under other sampling fields than D's request names (a proxy
# that changed or dropped them on P's leg).
FirstTokenReason = Literal["structured_output", "recurrent_state", "logprobs_mismatch", "no_first_token",
                           "sampling_mismatch"]


def first_draw_key(sampling: SamplingParams) -> str:
    """sha256 of what decides a request's first draw: temperature, top-p/k, seed, penalties, bias, and
    whether min_tokens bans a stop token there (the stop token ids it bans). P and D compute it alike."""
    bans_stops = sampling.min_tokens >= 1
    fields = [sampling.temperature if not sampling.greedy else 0.0, sampling.top_p, sampling.top_k, sampling.seed,
              sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
              sorted(sampling.logit_bias), bans_stops, sorted(sampling.stop_token_ids) if bans_stops else [],
              sampling.ignore_eos if bans_stops else None]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def usable_first_token(ticket: PinTicket, sampling: SamplingParams,
                       takes_first_token: bool) -> tuple[Optional[FirstToken], Optional[FirstTokenReason]]:
    """P's first token when D may start from it, else None and why (`takes_first_token`: False on a
    worker whose model keeps recurrent state)."""
    first = ticket.first_token
    if first is None:
        return None, "no_first_token"
    if not takes_first_token:
        return None, "recurrent_state"
    if sampling.grammar is not None:
        return None, "structured_output"
    if first.sampling_sha256 != first_draw_key(sampling):
        return None, "sampling_mismatch"
    if sampling.logprobs and (first.logprob is None or first.num_top_logprobs != sampling.top_logprobs):
        return None, "logprobs_mismatch"
    return first, None
