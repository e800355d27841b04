"""KV offload benchmark (`python -m bench.kv_offload`): a multi-turn chat workload whose working set
is several times the pool, run with no tier, the memory tier and the file tier in one process (real
engines, the embedded SmolLM2, CPU); prompt tokens computed, TTFT, the tier's hit rate and load
bandwidth per tier. `--repeats N` rotates the three N times so a slow moment hits one of each.
Then, or alone with `--loads-only`, loads.py's load bandwidth against raw copies.

Invariant: every configuration sees the same requests in the same order, greedy, so all must
answer the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Optional


import torch

from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.app.engine_factory import build_engine
from pdserve.metrics import Metrics
from pdserve.models.loader import load_model
from pdserve.request import GenerationRequest

from bench.kv_offload.loads import load_bandwidth, print_load_table
from bench.lib.report import cell, markdown_table, write_document
from bench.lib.stats import percentile

BLOCK = 16


def conversations(num: int, turns: int, user_tokens: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """user messages: [conversation][turn] -> token ids."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(10, vocab, (user_tokens,), generator=generator).tolist() for _ in range(turns)]
            for _ in range(num)]


def run(loaded, num_blocks: int, offload_bytes: Optional[int], offload_dir: Optional[str], messages,
        answer_tokens: int) -> dict:
    config = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, kv_offload_bytes=offload_bytes,
                                            kv_offload_dir=offload_dir),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_running=4))
    metrics = Metrics()
    built = build_engine(config, metrics, loaded)
    loop = built.engine.engine_loop
    sampling = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in messages]
    ttfts, answers = [], []
    for turn in range(len(messages[0])):
        for index, turn_messages in enumerate(messages):
            prompt = histories[index] + turn_messages[turn]
            outputs: list = []
            first: list[float] = []

            def sink(output, outputs=outputs, first=first):  # noqa: ANN001
                if not first and output.new_token_ids:
                    first.append(time.perf_counter())
                outputs.append(output)

            started = time.perf_counter()
            loop.submit(GenerationRequest(f"c{index}-t{turn}", tuple(prompt), sampling), sink)
            loop.run_until_idle()
            ttfts.append(first[0] - started)
            answer = [t for output in outputs for t in output.new_token_ids]
            answers.append(answer)
            histories[index] = prompt + answer
    stats = built.kv_manager.prefix_stats
    value = metrics.registry.get_sample_value
    load_s = value("pdserve_kv_offload_duration_seconds_sum", {"direction": "load"}) or 0.0
    load_bytes = value("pdserve_kv_offload_bytes_total", {"direction": "load"}) or 0.0
    result = {
        "tier": "file" if offload_dir else "memory" if offload_bytes else "none",
        "computed_prompt_tokens": loop.stats.num_computed_prompt_tokens,
        "prompt_tokens": stats.num_query_tokens,
        "ttfts_s": ttfts,
        "later_turn_ttfts_s": ttfts[len(messages):],  # requests go turn by turn
        "tier_hit_rate": stats.num_offload_hit_tokens / max(1, stats.num_query_tokens),
        "load_bytes": load_bytes,
        "load_s": load_s,
        "page_bytes": built.layout.page_bytes,
        "stores_skipped": built.kv_manager.offload.stats.num_skipped_stores if built.kv_manager.offload else 0,
        "answers": answers,
    }
    built.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--answer-tokens", type=int, default=192,
                        help="greedy tokens per answer (the default: twice the user message, as in chat logs)")
    parser.add_argument("--pool-share", type=float, default=0.25, help="pool size / working set")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="run the three configurations this many times, "
                        "in rotation, and pool their TTFTs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="draw computed tokens, TTFT and hit rate per tier (PNG)")
    parser.add_argument("--plot-from", default=None, help="draw --plot from this --out report instead of measuring")
    parser.add_argument("--dir", default=None, help="where the file tier goes (default: a temporary directory)")
    parser.add_argument("--page-bytes", type=int, default=737_280, help="page size of the load benchmark "
                        "(default: the embedded SmolLM2's, 16 tokens)")
    parser.add_argument("--loads-only", action="store_true", help="only the tiers' load bandwidth against raw copies")
    parser.add_argument("--load-rounds", type=int, default=200, help="loads per mode")
    parser.add_argument("--load-pages", type=int, default=16, help="pages per load (one request's prefix)")
    parser.add_argument("--load-out", default=None, help="write the load figures as JSON here")
    args = parser.parse_args()
    if args.plot_from:
        from bench.lib.plots import plot_offload_ttft

        with open(args.plot_from, encoding="utf-8") as f:
            print(f"wrote {plot_offload_ttft(json.load(f)['rows'], args.plot or args.plot_from[:-5] + '.png')}")
        return
    torch.set_num_threads(args.threads)
    if not args.loads_only:
        run_workload(args)
    bandwidth = load_bandwidth(args.page_bytes, args.dir or tempfile.mkdtemp(prefix="pdserve-kv-offload-"),
                               args.load_rounds, args.load_pages)
    print_load_table(bandwidth)
    if args.load_out:
        write_document(args.load_out, {"args": vars(args), **bandwidth}, indent=2)


def pooled(runs: list[dict]) -> dict:
    """One configuration's repeats as one row: counts from the first (every repeat computes the same),
    TTFTs pooled, load bandwidth over all bytes and seconds."""
    ttfts = [ttft for one in runs for ttft in one["ttfts_s"]]
    later = [ttft for one in runs for ttft in one["later_turn_ttfts_s"]]
    load_s = sum(one["load_s"] for one in runs)
    return {**runs[0], "ttfts_s": ttfts, "later_turn_ttfts_s": later,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 99),
            "later_turn_ttft_p50_s": statistics.median(later),
            "load_gb_per_s": sum(one["load_bytes"] for one in runs) / load_s / 1e9 if load_s else None}


def run_workload(args: argparse.Namespace) -> None:
    loaded = load_model(args.model, torch.float32, torch.device("cpu"))
    messages = conversations(args.conversations, args.turns, args.user_tokens, loaded.model.spec.vocab_size)
    final_tokens = args.turns * (args.user_tokens + args.answer_tokens)
    working_set_blocks = args.conversations * -(-final_tokens // BLOCK) * 1  # one group on SmolLM2-like models
    num_blocks = max(-(-final_tokens // BLOCK) + 2, int(working_set_blocks * args.pool_share)) + 1
    directory = args.dir or tempfile.mkdtemp(prefix="pdserve-kv-offload-")
    tier_bytes = (8 * num_blocks) << 20  # twice the working set or more: the pool is the bottleneck
    repeats: list[list[dict]] = []
    for _ in range(args.repeats):
        repeats.append([run(loaded, num_blocks, offload_bytes, offload_dir, messages, args.answer_tokens)
                        for offload_bytes, offload_dir in ((None, None), (tier_bytes, None), (tier_bytes, directory))])
    assert all(row["answers"] == repeats[0][0]["answers"] for rows in repeats for row in rows), "a tier changed an answer"
    rows = [pooled([rows[index] for rows in repeats]) for index in range(3)]
    print(f"pool {num_blocks - 1} blocks, working set {working_set_blocks} blocks, "
          f"{args.conversations} conversations x {args.turns} turns")
    print(markdown_table(
        ["tier", "computed", "of", "TTFT p50 ms", "TTFT p99 ms", "p50 turns 2+ ms", "p50 / none", "tier hit",
         "load GB/s", "skipped stores"],
        [(row["tier"], row["computed_prompt_tokens"], row["prompt_tokens"], cell(row["ttft_p50_s"], ".1f", 1000),
          cell(row["ttft_p99_s"], ".1f", 1000), cell(row["later_turn_ttft_p50_s"], ".1f", 1000),
          f"{row['ttft_p50_s'] / rows[0]['ttft_p50_s']:.2f}", f"{row['tier_hit_rate']:.2f}",
          cell(row["load_gb_per_s"]), row["stores_skipped"]) for row in rows]))
    if args.repeats > 1:
        for tier in (1, 2):
            ratios = [statistics.median(rows[tier]["ttfts_s"]) / statistics.median(rows[0]["ttfts_s"])
                      for rows in repeats]
            print(f"{rows[tier]['tier']} tier, TTFT p50 / no tier, per repeat: "
                  + " ".join(f"{ratio:.2f}" for ratio in ratios))
    if args.plot:
        from bench.lib.plots import plot_offload_ttft  # matplotlib only when a plot is asked for

        print(f"wrote {plot_offload_ttft(rows, args.plot)}")
    document = {"args": vars(args), "rows": [{k: v for k, v in row.items() if k != "answers"} for row in rows],
                "repeats": [[{k: v for k, v in row.items() if k != "answers"} for row in rows] for rows in repeats]}
    if args.out:
        write_document(args.out, document, indent=2)


if __name__ == "__main__":
    main()
