"""Multi-turn chat workload: conversations over a handful of shared system prompts, Poisson arrivals
(or all at once: N concurrent users), and a think time after each answer, fixed or exponential.

Invariant: the workload is a pure function of its spec and seed: every
routing policy is measured on the very same conversations (system prompt,
questions, number of turns, arrival time, think times); only the answers, which each turn
appends to the history, come from the server (greedy, so they agree too).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

TOPICS = ("volcanoes", "the Roman empire", "sourdough bread", "chess openings", "tide pools", "jazz harmony",
          "bridge design", "honey bees", "glaciers", "the printing press", "comets", "origami", "coral reefs",
          "wind turbines", "the silk road", "octopuses", "lighthouses", "desert plants", "submarines", "tea")
QUESTIONS = ("Tell me one surprising fact about {topic}.", "Why does that happen with {topic}?",
             "How would you explain {topic} to a child?", "What is a common mistake people make about {topic}?",
             "Give me a short example related to {topic}.", "What changed about {topic} in the last century?",
             "Which book would you suggest on {topic}?", "Summarize what we said about {topic} in one line.")
PERSONAS = ("a patient science teacher", "a concise travel guide", "a friendly museum curator",
            "a careful research librarian", "a cheerful cooking instructor", "a precise technical writer")
RULES = ("Answer in at most two short sentences.", "Never use lists or headings.", "Stay polite and factual.",
         "If you are unsure, say so plainly.", "Prefer simple words over jargon.", "Do not repeat the question.",
         "Keep numbers exact and units explicit.", "Mention one concrete example whenever you can.")
THINK_DISTRIBUTIONS = ("fixed", "exponential")


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    index: int
    system_prompt: str
    questions: tuple[str, ...]  # one per turn
    arrival_s: float  # when its first turn is sent, relative to the run's start
    think_times_s: tuple[float, ...]  # after each answer but the last, before the next question


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_conversations: int = 12
    min_turns: int = 4
    max_turns: int = 8
    num_system_prompts: int = 3
    system_prompt_sentences: int = 10  # about 120-200 tokens each: the shared prefix
    conversations_per_s: float = 0.2  # Poisson arrivals of conversations; 0: all at once (concurrent users)
    max_tokens: int = 32  # each answer (EOS ignored, so every policy sees the same lengths)
    think_time_s: float = 0.5  # between an answer and the next question: the value, or the exponential's mean
    think_distribution: str = "fixed"  # THINK_DISTRIBUTIONS
    seed: int = 0

    def describe(self) -> dict:
        return asdict(self)


def system_prompts(spec: WorkloadSpec, rng: random.Random) -> list[str]:
    prompts = []
    for index in range(spec.num_system_prompts):
        persona = PERSONAS[index % len(PERSONAS)]
        rules = [rng.choice(RULES) for _ in range(spec.system_prompt_sentences)]
        prompts.append(f"You are {persona} (assistant #{index}). " + " ".join(rules))
    return prompts


def build_conversations(spec: WorkloadSpec) -> list[ConversationSpec]:
    if not 1 <= spec.min_turns <= spec.max_turns:
        raise ValueError("turns must satisfy 1 <= min_turns <= max_turns")
    if spec.think_distribution not in THINK_DISTRIBUTIONS or spec.think_time_s < 0 or spec.conversations_per_s < 0:
        raise ValueError(f"think distribution must be one of {THINK_DISTRIBUTIONS}, times and rates >= 0")
    rng = random.Random(spec.seed)
    think_rng = random.Random(spec.seed + 7919)  # its own stream: the same seed still gives the same questions
    prompts = system_prompts(spec, rng)
    conversations, arrival_s = [], 0.0
    for index in range(spec.num_conversations):
        topic = TOPICS[index % len(TOPICS)]
        num_turns = rng.randint(spec.min_turns, spec.max_turns)
        questions = tuple(f"({index}.{turn}) " + rng.choice(QUESTIONS).format(topic=topic)
                          for turn in range(num_turns))
        think_times_s = tuple(think_rng.expovariate(1 / spec.think_time_s)
                              if spec.think_distribution == "exponential" and spec.think_time_s else spec.think_time_s
                              for _ in range(num_turns - 1))
        conversations.append(ConversationSpec(index, prompts[index % len(prompts)], questions, arrival_s,
                                              think_times_s))
        arrival_s += rng.expovariate(spec.conversations_per_s) if spec.conversations_per_s else 0.0
    return conversations
