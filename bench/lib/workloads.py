"""Workloads: synthetic serving requests (length distributions, classes, prompts, Poisson arrivals) and
the good chat/completion calls with greedy answers that soak and chaos judge answers against.

Invariant: a workload is a pure function of its spec and seed, so two systems
benchmarked with the same arguments get the very same prompts, output lengths
and arrival offsets, in the same order.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import httpx

from bench.lib.load import Call
from bench.lib.stream import RequestRecord, read_sync

# Ids far from SmolLM2's special tokens (0-16) and inside every Llama-family
# vocabulary we serve (>= 32000): any model under test accepts them.
PROMPT_TOKEN_ID_LOW = 1000
PROMPT_TOKEN_ID_HIGH = 20000  # exclusive

_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


class WorkloadError(ValueError):
    """A workload spec that cannot be built (bad syntax, empty range, fractions that do not add up)."""


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Token counts drawn uniformly from [low, high]; low == high is a fixed length."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        """'128' (fixed) or '100-300' (uniform, both ends included)."""
        match = _RANGE.fullmatch(text)
        if match is None:
            raise WorkloadError(f"not a length or length range: {text!r} (use 128 or 100-300)")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if low < 1 or high < low:
            raise WorkloadError(f"length range {text!r} must satisfy 1 <= low <= high")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def describe(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in a mix, e.g. long prompts with short answers."""

    name: str
    input_len: LengthRange
    output_len: LengthRange
    fraction: float

    def describe(self) -> str:
        return f"{self.name}:{self.input_len.describe()}:{self.output_len.describe()}:{self.fraction:g}"


def parse_mix(text: str) -> list[RequestClass]:
    """'long:2000:32:0.2,short:100-200:128:0.8' -> classes (name:input:output:fraction each)."""
    classes = []
    for item in (part for part in text.split(",") if part.strip()):
        fields = item.strip().split(":")
        if len(fields) != 4:
            raise WorkloadError(f"mix entry {item!r} is not name:input:output:fraction")
        name, input_text, output_text, fraction_text = fields
        try:
            fraction = float(fraction_text)
        except ValueError:
            raise WorkloadError(f"fraction {fraction_text!r} of {name!r} is not a number") from None
        if not name or fraction <= 0:
            raise WorkloadError(f"mix entry {item!r} needs a name and a positive fraction")
        classes.append(RequestClass(name, LengthRange.parse(input_text), LengthRange.parse(output_text), fraction))
    if not classes:
        raise WorkloadError("the mix is empty")
    if len({c.name for c in classes}) != len(classes):
        raise WorkloadError(f"class names repeat in {text!r}")
    total = sum(c.fraction for c in classes)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise WorkloadError(f"mix fractions add up to {total:g}, not 1")
    return classes


def single_class(input_len: str, output_len: str) -> list[RequestClass]:
    return [RequestClass("all", LengthRange.parse(input_len), LengthRange.parse(output_len), 1.0)]


def long_class_name(classes: Sequence[RequestClass]) -> Optional[str]:
    """The class whose prompts are longest on average; None when there is nothing to contrast it with."""
    if len(classes) < 2:
        return None
    return max(classes, key=lambda c: c.input_len.mean).name


def class_counts(classes: Sequence[RequestClass], num_requests: int) -> list[int]:
    """Exact counts per class (largest remainder), so a short run still has its share of long prompts."""
    quotas = [c.fraction * num_requests for c in classes]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(classes)), key=lambda i: quotas[i] - counts[i], reverse=True)
    for i in by_remainder[: num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def poisson_offsets_s(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at `request_rate`/s; the first request goes at 0.

    An infinite rate sends everything at once (a burst)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    offsets, now_s = [], 0.0
    for index in range(num_requests):
        if index > 0:
            now_s += rng.expovariate(request_rate)
        offsets.append(now_s)
    return offsets


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    index: int
    class_name: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_offset_s: float


def build_requests(classes: Sequence[RequestClass], num_requests: int, request_rate: float,
                   seed: int) -> list[SyntheticRequest]:
    """The whole workload: classes shuffled over the requests, random prompt ids, Poisson arrivals.

    Prompts are random token ids, so no two requests share a prefix worth caching."""
    if num_requests < 1:
        raise WorkloadError(f"need at least one request, got {num_requests}")
    if not request_rate > 0:
        raise WorkloadError(f"request rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    labels = [c for c, count in zip(classes, class_counts(classes, num_requests)) for _ in range(count)]
    rng.shuffle(labels)
    offsets = poisson_offsets_s(num_requests, request_rate, rng)
    requests = []
    for index, (request_class, offset_s) in enumerate(zip(labels, offsets)):
        num_prompt_tokens = request_class.input_len.sample(rng)
        prompt = tuple(rng.randrange(PROMPT_TOKEN_ID_LOW, PROMPT_TOKEN_ID_HIGH) for _ in range(num_prompt_tokens))
        requests.append(SyntheticRequest(index, request_class.name, prompt, request_class.output_len.sample(rng),
                                         offset_s))
    return requests


def warmup_requests(num_requests: int, seed: int) -> list[SyntheticRequest]:
    """A few short requests to warm a server up; a different seed keeps their prompts out of the run's."""
    rng = random.Random(seed ^ 0x5EED)
    return [SyntheticRequest(-1 - i, "warmup",
                             tuple(rng.randrange(PROMPT_TOKEN_ID_LOW, PROMPT_TOKEN_ID_HIGH) for _ in range(64)), 8, 0.0)
            for i in range(num_requests)]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where synthetic requests go and how they are spelled.

    `logprobs=0` makes the server emit every token as its own chunk (a token
    whose text is still an incomplete character would otherwise be merged into
    the next chunk), so inter-token gaps are per token, not per visible piece."""

    base_url: str
    model: Optional[str] = None
    with_logprobs: bool = True

    def body(self, request: SyntheticRequest) -> dict:
        body = {"prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.with_logprobs:
            body["logprobs"] = 0
        return body

    def calls(self, requests: Sequence[SyntheticRequest]) -> list[Call]:
        return [Call("/v1/completions", self.body(r), r.arrival_offset_s, r.index, r.class_name,
                     len(r.prompt_token_ids), r.max_tokens) for r in requests]


MODEL = "SmolLM2-135M-Instruct"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOPICS = ["the sea", "a dragon", "mountains", "a robot", "the moon", "bread", "a violin", "winter", "a city",
          "a garden"]


def good_calls() -> list[Call]:
    """Completions and chats, streamed and not, greedy: each has one right answer, its baseline."""
    calls = []
    for index, topic in enumerate(TOPICS):
        stream = index % 2 == 1
        calls.append(Call(COMPLETIONS, {
            "model": MODEL, "prompt": f"Write one sentence about {topic}.", "max_tokens": 8 + index % 5,
            "temperature": 0, "stream": stream}, name=f"completion-{index}"))
        calls.append(Call(CHAT, {
            "model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": 8 + index % 5, "temperature": 0, "stream": not stream}, name=f"chat-{index}"))
    return calls


def baselines(base_url: str, calls: Sequence[Call], timeout_s: float) -> dict[str, str]:
    """Each call's answer asked alone, one at a time: what a loaded run must answer again."""
    answers = {}
    with httpx.Client(timeout=timeout_s) as client:
        for call in calls:
            record = read_sync(client, base_url + call.path, call.body, record=RequestRecord(class_name=call.name))
            if record.status != 200 or record.error or not record.finished:
                raise RuntimeError(f"baseline {call.name} failed: {record.status} {record.error}")
            answers[call.name] = record.text
    return answers
