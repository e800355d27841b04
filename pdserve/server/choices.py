"""Fan-out of one HTTP request into engine requests, one per choice, and the merge of their outputs.

Choice `p * n + j` answers prompt p (batched completions) with its j-th
sample. Choice j = 0 of each prompt is its leader: it starts at once and
carries the request's kv_transfer_params; its siblings start when the
leader's first output arrives, when the prompt's KV is computed (or pulled)
and its full blocks are in the prefix cache, so they share them (reference
counts, no copy; on a decode worker one pull serves every choice) and compute
only the prompt's last partial block. Sibling j draws with seed + j.

Invariants: every reserved id is released exactly once (the engine releases
the ids of started choices, `aclose` those never started); one failed choice
fails the request and aborts every other choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Optional, Union

import anyio

from pdserve.api.peer_pull import PeerHint
from pdserve.api.sampling import SamplingParams
from pdserve.engine.request_ids import MAX_REQUEST_ID_CHARS, RequestIdRegistry
from pdserve.request import GenerationRequest, RequestOutput
from pdserve.server.context import ServingContext
from pdserve.server.generation import GenerationStream
from pdserve.server.preprocess import PreparedRequest

_SEED_SPAN = 2**64  # torch seeds are 64-bit


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    prompt_index: int
    request: GenerationRequest
    leader: Optional[int] = None  # the choice whose first output this one waits for


def _sibling_sampling(sampling: SamplingParams, number: int) -> SamplingParams:
    seed = sampling.seed
    if seed is not None:
        seed = seed + number if seed + number < _SEED_SPAN else seed + number - _SEED_SPAN
    # The leader reports the prompt's logprobs for every choice of its prompt.
    return dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)


def _sibling_id(base: str, index: int, registry: RequestIdRegistry) -> str:
    wanted = f"{base}-{index}"
    if len(wanted) > MAX_REQUEST_ID_CHARS:
        wanted = f"{uuid.uuid4().hex}-{index}"
    return registry.reserve(wanted)


def plan_choices(prepared: PreparedRequest, request_id: str, registry: RequestIdRegistry,
                 peer_hint: Optional[PeerHint] = None) -> list[Choice]:
    """Every choice of the request; `request_id` (already reserved) serves choice 0, the others reserve theirs.
    A peer hint goes with choice 0 (its siblings start once it cached the prompt)."""
    choices: list[Choice] = []
    n = prepared.num_choices
    try:
        for prompt_index, (prompt, sampling) in enumerate(zip(prepared.prompts, prepared.sampling)):
            for number in range(n):
                index = prompt_index * n + number
                choice_id = request_id if index == 0 else _sibling_id(request_id, index, registry)
                if number == 0:
                    request = GenerationRequest(choice_id, prompt, sampling, kv_params=prepared.kv_params,
                                                peer_hint=peer_hint if prompt_index == 0 else None)
                    choices.append(Choice(index, prompt_index, request))
                else:
                    request = GenerationRequest(choice_id, prompt, _sibling_sampling(sampling, number))
                    choices.append(Choice(index, prompt_index, request, leader=prompt_index * n))
    except BaseException:
        for choice in choices[1:]:
            registry.release(choice.request.request_id)
        raise
    return choices


_Item = tuple[int, Union[RequestOutput, BaseException]]


class ChoiceStreams:
    """Async iterator of (choice index, output) over every choice, in arrival order; ends after the last final."""

    def __init__(self, ctx: ServingContext, choices: list[Choice], arrival_s: float):
        self.choices = choices
        self._ctx = ctx
        self._arrival_s = arrival_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams: dict[int, GenerationStream] = {}
        self._tasks: list[asyncio.Task] = []
        self._num_unfinished = len(choices)
        self._started = False
        self._closed = False
        self.pd_recomputed = False  # D: an output said the prompt came as P/D and was computed here

    def __aiter__(self) -> "ChoiceStreams":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._started:
            self._started = True
            for choice in self.choices:
                if choice.leader is None:
                    self._start(choice)
        if self._num_unfinished == 0:
            raise StopAsyncIteration
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._num_unfinished -= 1
        self.pd_recomputed = self.pd_recomputed or item.pd_recomputed
        return index, item

    def _start(self, choice: Choice) -> None:
        try:
            stream = GenerationStream(self._ctx, choice.request, self._arrival_s)
        except BaseException as exc:  # the engine refused before taking the id: it is still ours
            self._queue.put_nowait((choice.index, exc))
            return
        self._streams[choice.index] = stream
        self._tasks.append(asyncio.ensure_future(self._pump(choice, stream)))

    async def _pump(self, choice: Choice, stream: GenerationStream) -> None:
        followers = [c for c in self.choices if c.leader == choice.index]
        try:
            async for output in stream:
                self._queue.put_nowait((choice.index, output))
                while followers:  # the prompt's KV is in place now
                    self._start(followers.pop(0))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put_nowait((choice.index, exc))

    async def aclose(self) -> None:
        """Idempotent: abort unfinished choices, release the ids of choices never started."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            # The pumps first: a stream cannot be closed while a pump is inside it.
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for stream in list(self._streams.values()):
                await stream.aclose()
        for choice in self.choices:
            if choice.index not in self._streams:
                self._ctx.request_ids.release(choice.request.request_id)
