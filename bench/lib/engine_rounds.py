"""Decode time of an in-process engine loop, apart from its prefill: shared by the kernel benches
that drive `EngineLoop` directly (bench/kernels/moe.py, bench/kernels/tp_rank.py).

Invariant: each round submits the same prompts twice under fresh request ids, once for one token
(the prefill alone) and once for `new_tokens + 1`; the difference is the decode steps' time.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pdserve.api.sampling import SamplingParams
from pdserve.request import GenerationRequest


def decode_seconds(loop, prompts: Sequence[tuple[int, ...]], new_tokens: int, rounds: int,  # noqa: ANN001
                   clock: Callable[[], float]) -> list[float]:
    """Per round, the seconds `new_tokens` decode steps of all `prompts` together took (after a warm-up)."""

    def run(max_tokens: int, tag: str) -> float:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            loop.submit(GenerationRequest(f"{tag}-{index}", prompt, sampling), lambda output: None)
        started = clock()
        loop.run_until_idle()
        return clock() - started

    run(2, "warm")
    return [run(new_tokens + 1, f"decode{r}") - run(1, f"prefill{r}") for r in range(rounds)]
