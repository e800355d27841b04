"""The fixed workload of the engine benchmark: prompts, lengths and request counts.

Invariant: every measured request has a prompt no other request (warm-up or
measured, any system) shares past the chat template's system preamble, so a
prefix cache cannot turn one system's prefill into a free lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

_FIRST_WARMUP_INDEX = 100_000

_TOPICS = (
    "a delayed train connection", "a broken laptop hinge", "a double-charged invoice", "a lost hotel booking",
    "a noisy refrigerator", "a late grocery delivery", "a locked online account", "a cracked phone screen",
    "a missing parcel", "a cancelled concert ticket", "a leaking washing machine", "a wrong pizza order",
    "a slow home internet line", "a faulty electric kettle", "an unreadable utility bill", "a stuck garage door",
)

# Shared body after the unique header; about 130 tokens with SmolLM2's tokenizer.
_BODY = (
    "You are answering on behalf of a small consumer support team. Read the situation carefully, "
    "then write a calm and friendly reply that first acknowledges the problem, then explains in plain "
    "words what most likely went wrong, then lists the concrete steps the customer should take today, "
    "in order, with the information they must have ready (order number, dates, photos, receipts). "
    "Mention what the team will do on its side and how long each step usually takes. Avoid jargon, "
    "do not promise refunds you cannot grant, and do not blame the customer. Close with one sentence "
    "that tells them how to reach a human if the steps do not help. Keep the whole answer well organised."
)


# Sentences of the long-prompt (time to first token) requests: a support log, one line per
# event, so that the prompt reads like text a deployment would really receive.
_LOG_LINE = ("Entry {n}: the customer called again about {topic}, was asked for the order number and "
             "the delivery date, and was told that the case stays open until the courier replies.")
LONG_PROMPT_FIRST_INDEX = 200_000  # far from the throughput phases' prompts and their warm-ups


def chat_messages(index: int) -> list[dict[str, str]]:
    """Messages of request `index`; the header that makes it unique comes first."""
    topic = _TOPICS[index % len(_TOPICS)]
    return [{"role": "user", "content": f"Ticket #{1000 + index}, about {topic}. {_BODY}"}]


def long_prompt_messages(index: int, num_lines: int) -> list[dict[str, str]]:
    """A long, unique prompt: a ticket header, `num_lines` log lines, then the request."""
    topic = _TOPICS[index % len(_TOPICS)]
    lines = " ".join(_LOG_LINE.format(n=n + 1, topic=_TOPICS[(index + n) % len(_TOPICS)]) for n in range(num_lines))
    return [{"role": "user", "content": f"Ticket #{1000 + index}, about {topic}. Call log: {lines} "
                                        f"Summarise the case in three sentences."}]


@dataclass(frozen=True, slots=True)
class Workload:
    """How much work each measured phase does; identical for every system."""

    max_tokens: int
    num_requests_by_concurrency: dict[int, int]
    num_warmup_tokens: int = 8
    long_prompt_tokens: int = 1024  # time to first token is measured on prompts this long
    num_long_prompts: int = 3

    @property
    def concurrencies(self) -> tuple[int, ...]:
        return tuple(sorted(self.num_requests_by_concurrency))

    @property
    def num_requests(self) -> int:
        return sum(self.num_requests_by_concurrency.values())

    def prompt_indices(self, concurrency: int, attempt: int = 0) -> list[int]:
        """Indices of the prompts of one phase; phases and their repeats never share an index."""
        start = attempt * self.num_requests
        for level in self.concurrencies:
            count = self.num_requests_by_concurrency[level]
            if level == concurrency:
                return list(range(start, start + count))
            start += count
        raise KeyError(f"no phase at concurrency {concurrency}")

    def long_prompt_indices(self) -> list[int]:
        return list(range(LONG_PROMPT_FIRST_INDEX, LONG_PROMPT_FIRST_INDEX + self.num_long_prompts))

    def warmup_indices(self, count: int) -> list[int]:
        """Warm-up prompts sit far past every measured one (repeats included), so they never seed a cache hit."""
        return list(range(_FIRST_WARMUP_INDEX, _FIRST_WARMUP_INDEX + count))


def full_workload() -> Workload:
    return Workload(max_tokens=128, num_requests_by_concurrency={1: 6, 4: 8, 16: 16})


def quick_workload() -> Workload:
    return Workload(max_tokens=32, num_requests_by_concurrency={1: 2, 4: 4, 16: 16}, num_long_prompts=1)
