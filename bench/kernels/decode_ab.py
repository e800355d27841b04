"""A decode-step change measured side by side: `decode`'s profile of this tree (or `--candidate`, a
commit) against an earlier commit's.

The commit's files (`git archive`) go to a temporary folder with this tree's bench/ copied over
them, so both sides are measured by the same code; then `python -m bench.kernels decode --rounds 1`
runs in each tree in turn, `--pairs` times (the order alternating), and each part's figure is the
median over a side's runs. Each tree builds its own kernel library once (cached by its sources).
Ratios are baseline / this tree: above 1, this tree is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from bench.kernels import decode
from bench.kernels.clocks import checked_clock
from bench.lib.report import markdown_table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PART_KEYS = ("layer.qkv", "layer.attention", "layer.o_proj", "layer.mlp_gate_up", "layer.mlp_down", "layer.experts",
              "layers_total",
              "final_norm", "lm_head", "sampling", "python_outside_model", "step")


def baseline_tree(revision: str, folder: str) -> str:
    """`revision`'s files in `folder`, with this tree's bench/ in place of its own."""
    os.makedirs(folder)
    archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    shutil.rmtree(os.path.join(folder, "bench"))
    shutil.copytree(os.path.join(REPO_ROOT, "bench"), os.path.join(folder, "bench"),
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    return folder


def profile_once(tree: str, args: argparse.Namespace, out_path: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.kernels", "decode", "--rounds", "1", "--out", out_path,
            "--batches", *map(str, args.batches), "--prompt-tokens", str(args.prompt_tokens),
            "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--clock", args.clock,
            "--kv-cache-dtypes", *args.kv_cache_dtypes, "--model", args.model]
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)


def medians(runs: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per batch, per part: the median over runs of each run's median milliseconds."""
    out: dict[int, dict[str, float]] = {}
    for summary in runs[0]["batches"]:
        batch = summary["batch"]
        per_run = [next(s for s in run["batches"] if s["batch"] == batch)["parts"] for run in runs]
        out[batch] = {key: statistics.median(parts[key]["median_ms"] for parts in per_run) for key in _PART_KEYS}
    return out


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    decode.add_arguments(parser, mode)
    parser.add_argument("--baseline", help="the commit to compare against (git revision; required)")
    parser.add_argument("--candidate", help="a commit to measure in place of this working tree")
    parser.add_argument("--pairs", type=int, default=3, help="runs per side, alternating")


def run(args: argparse.Namespace) -> tuple[str, dict]:
    if args.baseline is None:
        raise SystemExit("decode-ab needs --baseline REV, the commit to compare against")
    checked_clock(args)
    if len(args.kv_cache_dtypes) != 1:
        raise SystemExit("decode-ab compares trees at one --kv-cache-dtypes (decode compares types in one tree)")
    with tempfile.TemporaryDirectory(prefix="decode-ab-") as folder:
        candidate = REPO_ROOT if args.candidate is None else baseline_tree(args.candidate, os.path.join(folder, "new"))
        trees = {"baseline": baseline_tree(args.baseline, os.path.join(folder, "baseline")), "this tree": candidate}
        runs: dict[str, list] = {name: [] for name in trees}
        for pair in range(args.pairs):
            order = list(trees) if pair % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(profile_once(trees[name], args, os.path.join(folder, f"{pair}-{len(runs[name])}.json")))
    figures = {name: medians(side) for name, side in runs.items()}
    header = ["part (ms a step)"] + [f"b={b} {side}" for b in args.batches for side in ("baseline", "this tree", "ratio")]
    rows = []
    for key in _PART_KEYS:
        row: list[Any] = [key]
        for batch in args.batches:
            before, after = figures["baseline"][batch][key], figures["this tree"][batch][key]
            row += [f"{before:.3f}", f"{after:.3f}", f"{before / after:.2f}x" if after > 0 else "-"]
        rows.append(row)
    table = (f"baseline {args.baseline}, this tree {args.candidate or 'the working tree'}; {args.pairs} runs a side, "
             "alternating\n\n") + markdown_table(header, rows)
    return table, {"baseline": args.baseline, "figures": {name: {str(b): v for b, v in f.items()}
                                                          for name, f in figures.items()}}
