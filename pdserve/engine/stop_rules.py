"""Token-level stop conditions, checked after every sampled token.

Stop strings need text and live in the output processor; everything decidable
from token ids alone is decided here, so the scheduler frees blocks the same
step the request ends. Torch-free.
"""

from __future__ import annotations

from typing import Optional

from pdserve.api.sampling import FinishReason
from pdserve.request import Request


def check_stop(request: Request, max_model_len: int) -> Optional[FinishReason]:
    sampling = request.sampling
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_output >= sampling.min_tokens:
        if last in sampling.stop_token_ids:
            return FinishReason.STOP
        if not sampling.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP
    if num_output >= sampling.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
