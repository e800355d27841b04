"""Structured-output cost: engine tokens/s at concurrency 8 with and without a JSON-schema grammar.

    python -m bench.grammar [--rounds 11] [--max-tokens 32] [--out bench/results/grammar.json]

Invariant: both sides run in this one process on the same engine, weights,
prompts, seeds and output lengths, interleaved round by round (plain, grammar,
plain, grammar, ...) so outside load hits both alike; the figure is the ratio
of their medians, not an absolute time. Every request generates exactly
`max_tokens` tokens (ignore_eos), so both sides do the same number of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional

import torch

from bench.lib.launch import REPO_ROOT
from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.app.engine_factory import build_engine
from pdserve.grammar.compiler import compile_constraint
from pdserve.metrics import Metrics
from pdserve.request import GenerationRequest, SamplingParams
from pdserve.api.structured_protocol import OutputConstraint

CONCURRENCY = 8
# Nested, and long enough that the answer stays inside the grammar for the whole run.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}},
        "cast": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "role", "age"], "additionalProperties": False}},
    },
    "required": ["title", "year", "rating", "genres", "cast"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe a film as JSON.", "Give me a movie record in JSON.", "A comedy film, as JSON.",
             "JSON for an action movie.", "Describe a classic film in JSON.", "A horror movie as JSON.",
             "JSON describing a drama.", "Your favourite film, as JSON."]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "grammar.json"))
    return parser.parse_args(argv)


def run_batch(built, prompts: list[list[int]], sampling: SamplingParams, tag: str) -> tuple[int, float]:
    """All prompts at once on the calling thread; (output tokens, seconds)."""
    loop = built.engine.engine_loop
    counts = [0] * len(prompts)
    for index, prompt in enumerate(prompts):
        def sink(output, index=index):
            counts[index] += len(output.new_token_ids)
        request = GenerationRequest(f"{tag}-{index}", tuple(prompt), sampling)
        loop.submit(request, sink)
    started = time.perf_counter()
    loop.run_until_idle()
    return sum(counts), time.perf_counter() - started


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    config = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"), cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_running=CONCURRENCY))
    built = build_engine(config, Metrics())
    tokenizer = built.loaded.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in QUESTIONS[:CONCURRENCY]]
    grammar = compile_constraint(OutputConstraint("json_schema", schema=SCHEMA, param="response_format"))
    built.engine.grammar_tokenizer.get()  # built once per worker, at its first grammar: not measured
    base = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=0, ignore_eos=True)
    sides = {"plain": base, "json_schema": SamplingParams(**{**_fields(base), "grammar": grammar})}
    run_batch(built, prompts[:2], SamplingParams(max_tokens=4, temperature=0), "warm")
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name, sampling in sides.items():
            tokens, seconds = run_batch(built, prompts, sampling, f"{name}-{round_index}")
            rates[name].append(tokens / seconds)
            print(f"round {round_index} {name}: {tokens} tokens in {seconds:.2f} s", flush=True)
    built.close()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    cost = 1.0 - medians["json_schema"] / medians["plain"]
    # Each round's own ratio too: a burst of outside load that hits one side of one round moves
    # that round's ratio, and the median of the ratios shrugs it off.
    round_cost = 1.0 - statistics.median(g / p for g, p in zip(rates["json_schema"], rates["plain"]))
    print(f"concurrency {CONCURRENCY}, {args.max_tokens} tokens per request, {args.rounds} interleaved rounds")
    print(f"{'side':<14}{'median tok/s':>14}   rounds tok/s")
    for name, values in rates.items():
        print(f"{name:<14}{medians[name]:>14.1f}   {'  '.join(f'{v:.1f}' for v in values)}")
    print(f"grammar cost: {cost:.1%} of plain throughput by medians, {round_cost:.1%} by the median of "
          f"per-round ratios (target < 20%)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"concurrency": CONCURRENCY, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "tokens_per_s": rates, "median_tokens_per_s": medians, "grammar_cost_fraction": cost,
                   "grammar_cost_fraction_per_round_median": round_cost,
                   "machine": {"python": platform.python_version(), "torch": torch.__version__,
                               "cpus": os.cpu_count()}}, f, indent=2)
    return 0


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


if __name__ == "__main__":
    sys.exit(main())
