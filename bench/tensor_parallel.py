"""Tensor-parallel decode benchmark: one random-weight Llama checkpoint served by `pdserve serve -tp
N` for each N in --sizes, decode tokens/s at batch 1 (median over --repeats streamed requests,
tokens after the first chunk over the time from first to last chunk) and over --streams at once,
each as a ratio of TP=1's (the figure to read: machines are noisy). Every size gets the same
--num-threads, shared out over its ranks. Ranks exchange tensors and step records through shared
memory, all-reduced in native code (the default); --compare-gloo adds, after each size above 1,
the same size on gloo (`--no-tp-shared-memory`), and --compare-python-all-reduce the same size with
the shared memory's all-reduce in Python (`--no-tp-native-all-reduce`). --rounds N runs the whole
list N times in turn (TP=1, TP=2, ..., TP=1, ...): each round's ratios are against that round's
TP=1, and a last table gives their medians, so a slow spell of the machine lands on one round, not
on one size.

Invariant: one worker at a time, all its ranks stopped before the next starts (also on Ctrl-C or an
error); every size sees the same prompts; a size that failed is a row with its reason, never zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import httpx

from bench.lib.launch import REPO_ROOT, LaunchError, ServerProcess, free_port, pdserve_argv
from bench.lib.load import run_open_loop
from bench.lib.machine import CpuMeter, machine_info, wait_for_idle
from bench.lib.report import cell, markdown_table, write_document
from bench.lib.stats import percentile
from bench.lib.stream import RequestRecord
from bench.lib.tiny_model import save_tiny_checkpoint
from bench.lib.workloads import Endpoint, SyntheticRequest

logger = logging.getLogger("bench.tensor_parallel")

_READY_TIMEOUT_S = 300.0  # N ranks import torch and load their shards on the same few cores
_NUM_BLOCKS = 512
_PROMPT_TOKENS = 32
_WARMUP_TOKENS = 16
_NOISY_FOREIGN_FRACTION = 0.10
_FIRST_TOKEN_ID = 3  # ids 0-2 are the word tokenizer's <unk>, <eos> and <bos>
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")  # the last one in a log tail names the failure


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama whose query and KV head counts divide by 1, 2 and 3 (SmolLM2's 9/3 heads do not split in 2)."""

    num_layers: int = 12
    hidden_size: int = 576
    num_heads: int = 12
    num_kv_heads: int = 6
    head_dim: int = 48
    intermediate_size: int = 1536
    vocab_size: int = 8192
    max_position_embeddings: int = 2048

    def num_params(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        return self.num_layers * (attention + mlp + norms) + 2 * self.vocab_size * self.hidden_size + self.hidden_size


@dataclass(slots=True)
class SizeResult:
    """One TP size: its batch-1 runs and its concurrent-streams run, or why it could not run."""

    tp_size: int
    threads_per_rank: int
    tensor_path: str = "shared memory"  # or one of _PATH_FLAGS' other keys; TP=1 exchanges nothing
    batch1_runs_tokens_per_s: list[float] = field(default_factory=list)
    streams_tokens_per_s: Optional[float] = None
    streams_output_tokens: int = 0
    foreign_cpu_fraction: Optional[float] = None  # share of all cores other processes used while measuring
    machine_idle_before: Optional[bool] = None  # --wait-for-idle-s saw the machine go idle (None: not asked)
    error: Optional[str] = None
    round_index: int = 0  # --rounds: which pass over the sizes

    @property
    def label(self) -> str:
        """The row's name: its TP size, and the path when it is not the default."""
        return str(self.tp_size) if self.tensor_path == "shared memory" else f"{self.tp_size} ({self.tensor_path})"

    @property
    def batch1_tokens_per_s(self) -> Optional[float]:
        return None if self.error is not None else percentile(self.batch1_runs_tokens_per_s, 50)


# --- pure parts: no server -----------------------------------------------------------------------

def parse_sizes(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; each a positive integer, none twice."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes:
        raise ValueError("--sizes is empty")
    if any(size < 1 for size in sizes):
        raise ValueError(f"TP sizes must be at least 1, got {text!r}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"TP sizes repeat in {text!r}")
    return sizes


def check_divisible(shape: ModelShape, sizes: Sequence[int]) -> None:
    """Megatron sharding splits query and KV heads over the ranks: both counts must divide by every size."""
    bad = [size for size in sizes if shape.num_heads % size or shape.num_kv_heads % size]
    if bad:
        raise ValueError(f"{shape.num_heads} query / {shape.num_kv_heads} KV heads do not divide by TP size(s) {bad}")


def threads_per_rank(num_threads: int, tp_size: int) -> int:
    """What each rank gets of the worker's --num-threads (pdserve.runner.devices.rank_threads)."""
    return max(1, num_threads // tp_size)


def aggregate_decode_tokens_per_s(streams: Sequence[tuple[Sequence[float], Sequence[int]]]) -> Optional[float]:
    """Concurrent streams, each (chunk times, tokens per chunk): the tokens after each stream's first
    chunk, summed, over the wall span from the earliest first chunk to the latest last chunk."""
    streams = [(times, counts) for times, counts in streams if len(times)]
    if not streams:
        return None
    if any(len(times) != len(counts) for times, counts in streams):
        raise ValueError("one token count per chunk time expected")
    decoded = sum(sum(counts[1:]) for _, counts in streams)
    span_s = max(times[-1] for times, _ in streams) - min(times[0] for times, _ in streams)
    if decoded == 0 or span_s <= 0:
        return None
    return decoded / span_s


def decode_tokens_per_s(chunk_times_s: Sequence[float], chunk_num_tokens: Sequence[int]) -> Optional[float]:
    """One stream's: tokens after the first chunk (which holds prefill) over the first to last chunk."""
    return aggregate_decode_tokens_per_s([(chunk_times_s, chunk_num_tokens)])


def ratio(value: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """value / baseline; None when either is missing or the baseline is not positive."""
    if value is None or baseline is None or baseline <= 0:
        return None
    return value / baseline


def ratios(results: Sequence[SizeResult]) -> dict[str, dict[str, Optional[float]]]:
    """Per row (its label): batch-1 and streams tokens/s as a ratio of TP=1's (None without a working TP=1)."""
    base = next((r for r in results if r.tp_size == 1 and r.error is None), None)
    base_batch1 = base.batch1_tokens_per_s if base else None
    base_streams = base.streams_tokens_per_s if base else None
    return {r.label: {"batch1": ratio(r.batch1_tokens_per_s, base_batch1),
                        "streams": ratio(r.streams_tokens_per_s if r.error is None else None, base_streams)}
            for r in results}


def by_round(results: Sequence[SizeResult]) -> list[list[SizeResult]]:
    """The results of each round, rounds in order (each round's ratios use its own TP=1)."""
    rounds: dict[int, list[SizeResult]] = {}
    for result in results:
        rounds.setdefault(result.round_index, []).append(result)
    return [rounds[index] for index in sorted(rounds)]


def round_ratios(results: Sequence[SizeResult]) -> dict[str, dict[str, list[float]]]:
    """Per row label: its batch-1 and streams ratios vs TP=1, one per round that has both figures."""
    gathered: dict[str, dict[str, list[float]]] = {}
    for round_results in by_round(results):
        for label, figures in ratios(round_results).items():
            row = gathered.setdefault(label, {"batch1": [], "streams": []})
            for key, value in figures.items():
                if value is not None:
                    row[key].append(value)
    return gathered


def format_summary(results: Sequence[SizeResult], num_streams: int) -> str:
    """Markdown table over rounds: each row's per-round ratios vs TP=1 and their median."""
    def spread(values: list[float]) -> str:
        return " / ".join(f"{value:.2f}" for value in values) or "-"

    rows = [[label, spread(figures["batch1"]), _times(percentile(figures["batch1"], 50) if figures["batch1"] else None),
             spread(figures["streams"]), _times(percentile(figures["streams"], 50) if figures["streams"] else None)]
            for label, figures in round_ratios(results).items()]
    return markdown_table(["TP size", "batch-1 ratio per round", "median", f"{num_streams}-stream ratio per round",
                           "median"], rows)


def _times(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def short_error(text: str, limit: int = 160) -> str:
    """One line for a table cell: from the last `SomethingError: ...` in a log tail if there is one."""
    text = " ".join(text.split())
    matches = list(_EXCEPTION.finditer(text))
    if matches:
        text = text[matches[-1].start():]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_table(results: Sequence[SizeResult], num_streams: int) -> str:
    """Markdown table, one row per TP size; also fine on a terminal. `other CPU`: the share of all
    cores that processes other than the bench and the worker took while the size was measured."""
    by_size = ratios(results)
    rows = [[r.label, r.tp_size, r.threads_per_rank]
            + ([f"failed: {short_error(r.error)}", "-", "-", "-", "-"] if r.error is not None else
               [cell(r.batch1_tokens_per_s, ".1f"), _times(by_size[r.label]["batch1"]),
                cell(r.streams_tokens_per_s, ".1f"), _times(by_size[r.label]["streams"]),
                cell(r.foreign_cpu_fraction, ".0%")]) for r in results]
    return markdown_table(["TP size", "ranks", "threads per rank", "batch-1 decode tok/s", "ratio vs TP=1",
                           f"{num_streams}-stream tok/s", "ratio vs TP=1", "other CPU"], rows)


def report_dict(command: str, config: dict, machine: dict, results: Sequence[SizeResult]) -> dict:
    by_size = {(r.round_index, label): figures for round_results in by_round(results)
               for r in round_results[:1] for label, figures in ratios(round_results).items()}
    sizes = []
    for r in results:
        row = asdict(r)
        row.update(num_ranks=r.tp_size, batch1_tokens_per_s=r.batch1_tokens_per_s,
                   batch1_ratio_vs_tp1=by_size[r.round_index, r.label]["batch1"],
                   streams_ratio_vs_tp1=by_size[r.round_index, r.label]["streams"])
        sizes.append(row)
    medians = {label: {key: percentile(values, 50) if values else None for key, values in figures.items()}
               for label, figures in round_ratios(results).items()}
    return {"command": command, "config": config, "machine": machine, "sizes": sizes, "median_ratios_vs_tp1": medians}


def prompts(num_prompts: int, vocab_size: int, seed: int, length: int = _PROMPT_TOKENS) -> list[tuple[int, ...]]:
    """Random token ids in [3, vocab): past the tokenizer's special tokens, inside the model's vocabulary."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(length)) for _ in range(num_prompts)]


# --- the run: checkpoint, workers, requests ------------------------------------------------------

def build_checkpoint(directory: str, shape: ModelShape, seed: int) -> str:
    """A random-weight Llama in the HF layout (safetensors + a word-level tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=2, eos_token_id=1,
    )
    return save_tiny_checkpoint(LlamaForCausalLM(config).eval(), directory)


# How tensors go between ranks -> the worker flags that choose it (the default first).
_PATH_FLAGS = {"shared memory": (), "gloo": ("--no-tp-shared-memory",),
               "Python all-reduce": ("--no-tp-native-all-reduce",)}


def worker_argv(model_dir: str, port: int, tp_size: int, num_threads: int, num_blocks: int,
                tensor_path: str = "shared memory") -> list[str]:
    return pdserve_argv("serve", port, "--model", model_dir, "-tp", str(tp_size), "--host", "127.0.0.1",
                        "--device", "cpu", "--dtype", "float32", "--num-threads", str(num_threads),
                        "--num-blocks", str(num_blocks), "--log-level", "warning", *_PATH_FLAGS[tensor_path])


def _check(records: Sequence[RequestRecord], max_tokens: int) -> None:
    for record in records:
        if not record.ok:
            raise RuntimeError(f"request {record.index} failed: {record.error}")
        if record.num_output_tokens != max_tokens:
            raise RuntimeError(f"request {record.index} got {record.num_output_tokens} tokens, asked {max_tokens}")


def _load(endpoint: Endpoint, requests: Sequence[SyntheticRequest]) -> list[RequestRecord]:
    return run_open_loop(endpoint.base_url, endpoint.calls(requests)).records


def measure_worker(endpoint: Endpoint, args: argparse.Namespace, result: SizeResult) -> None:
    """Warm-up, batch-1 runs, then the concurrent streams, into `result`."""
    batch1_prompts = prompts(args.repeats, args.shape.vocab_size, args.seed)
    stream_prompts = prompts(args.streams, args.shape.vocab_size, args.seed + 1)
    warm = prompts(1, args.shape.vocab_size, args.seed + 2)[0]
    _check(_load(endpoint, [SyntheticRequest(-1, "warmup", warm, _WARMUP_TOKENS, 0.0)]), _WARMUP_TOKENS)
    for index, prompt in enumerate(batch1_prompts):
        record = _load(endpoint, [SyntheticRequest(index, "batch1", prompt, args.max_tokens, 0.0)])[0]
        _check([record], args.max_tokens)
        tokens_per_s = decode_tokens_per_s(record.chunk_times_s, record.chunk_num_tokens)
        if tokens_per_s is None:
            raise RuntimeError(f"batch-1 request {index}: fewer than two timed chunks")
        result.batch1_runs_tokens_per_s.append(tokens_per_s)
        logger.info("TP=%d batch 1, run %d: %.1f decode tok/s", result.tp_size, index + 1, tokens_per_s)
    requests = [SyntheticRequest(i, "streams", p, args.max_tokens, 0.0) for i, p in enumerate(stream_prompts)]
    records = _load(endpoint, requests)
    _check(records, args.max_tokens)
    result.streams_tokens_per_s = aggregate_decode_tokens_per_s(
        [(r.chunk_times_s, r.chunk_num_tokens) for r in records])
    result.streams_output_tokens = sum(r.num_output_tokens for r in records)
    logger.info("TP=%d %d streams: %s decode tok/s", result.tp_size, args.streams, cell(result.streams_tokens_per_s, '.1f'))


def run_size(model_dir: str, tp_size: int, args: argparse.Namespace, tensor_path: str = "shared memory") -> SizeResult:
    result = SizeResult(tp_size, threads_per_rank(args.num_threads, tp_size), tensor_path)
    port = free_port()
    suffix = "" if tensor_path == "shared memory" else "-" + tensor_path.split()[0].lower()
    server = ServerProcess(f"pdserve serve -tp {tp_size}{suffix}",
                           worker_argv(model_dir, port, tp_size, args.num_threads, args.num_blocks, tensor_path),
                           port, os.path.join(args.log_dir, f"tp{tp_size}{suffix}.log"))
    try:
        if args.wait_for_idle_s > 0:
            result.machine_idle_before = wait_for_idle(args.wait_for_idle_s)
        server.start()
        server.wait_ready(_READY_TIMEOUT_S)
        endpoint = Endpoint(server.base_url, server.model_id(), with_logprobs=True)
        meter = CpuMeter(server.pids())  # rank 0 and its ranks, once all of them are up
        meter.start()
        measure_worker(endpoint, args, result)
        result.foreign_cpu_fraction = meter.foreign_fraction()
        if (result.foreign_cpu_fraction or 0.0) > _NOISY_FOREIGN_FRACTION:
            logger.warning("TP=%d: other processes used %.0f%% of the CPUs meanwhile; its figures are not clean",
                           tp_size, result.foreign_cpu_fraction * 100)
    except (LaunchError, RuntimeError, httpx.HTTPError, KeyError, IndexError) as exc:
        result.error = " ".join(str(exc).split())[-1000:]
        logger.error("TP=%d failed: %s\nlog tail (%s):\n%s", tp_size, exc, server.log_path,
                     server.log_tail(3000) if server.process else "")
    finally:
        server.stop()  # rank 0 stops its ranks; any it left behind is killed
    return result


def config_dict(args: argparse.Namespace) -> dict:
    return {"sizes": args.sizes, "num_threads": args.num_threads, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "streams": args.streams, "prompt_tokens": _PROMPT_TOKENS,
            "warmup_tokens": _WARMUP_TOKENS, "num_blocks": args.num_blocks, "seed": args.seed, "dtype": "float32",
            "device": "cpu", "model": asdict(args.shape) | {"num_params": args.shape.num_params()},
            "wait_for_idle_s": args.wait_for_idle_s, "compare_gloo": args.compare_gloo,
            "compare_python_all_reduce": args.compare_python_all_reduce, "rounds": args.rounds,
            "log_dir": args.log_dir}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,3", help="TP sizes, one worker each, in this order")
    parser.add_argument("--num-layers", type=int, default=12, help="layers of the random Llama")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of each worker, shared out over its ranks (default: every usable core)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per request (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 requests per size (the median is reported)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams of the aggregate measurement")
    parser.add_argument("--num-blocks", type=int, default=_NUM_BLOCKS, help="KV pool of each worker, in blocks")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--wait-for-idle-s", type=float, default=0.0,
                        help="before each size, wait up to this long for the machine to go idle (0: do not wait)")
    parser.add_argument("--compare-gloo", action="store_true",
                        help="after each size above 1, run it again with gloo instead of shared memory")
    parser.add_argument("--compare-python-all-reduce", action="store_true",
                        help="after each size above 1, run it again with the shared memory's all-reduce in Python "
                             "(--no-tp-native-all-reduce)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the sizes this many times in turn; ratios per round, then their medians")
    parser.add_argument("--log-dir", default=None, help="worker logs (default: a temporary directory, kept)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "tensor_parallel.json"),
                        help="JSON report path")
    args = parser.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes)
        args.shape = ModelShape(num_layers=args.num_layers)
        check_divisible(args.shape, args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_threads is None:
        args.num_threads = len(os.sched_getaffinity(0)) or 1
    for name in ("num_layers", "num_threads", "repeats", "streams", "num_blocks", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (decode starts after the first token)")
    return args


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the `finally` that stops the worker


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    command = shlex.join(["python", "-m", "bench.tensor_parallel", *(argv if argv is not None else sys.argv[1:])])
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-tp-bench-")
    os.makedirs(args.log_dir, exist_ok=True)
    started_s = time.monotonic()
    machine = machine_info()  # before any worker: the commit and working tree the workers run
    results: list[SizeResult] = []
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-tp-model-") as model_dir:
            logger.info("building a random Llama: %s (%.1f M params)", args.shape, args.shape.num_params() / 1e6)
            build_checkpoint(model_dir, args.shape, args.seed)
            for round_index in range(args.rounds):
                for tp_size in args.sizes:  # one worker at a time: run_size stops it before returning
                    paths = ["shared memory"] + (["Python all-reduce"] if args.compare_python_all_reduce else []) \
                        + (["gloo"] if args.compare_gloo else [])
                    for path in paths if tp_size > 1 else paths[:1]:
                        results.append(run_size(model_dir, tp_size, args, path))
                        results[-1].round_index = round_index
    except KeyboardInterrupt:  # the worker is already stopped (run_size's finally); no report for half a run
        logger.warning("interrupted after %d rows; no report written", len(results))
        return 130
    for round_results in by_round(results):
        print(format_table(round_results, args.streams))
    if args.rounds > 1:
        print(format_summary(results, args.streams))
    report = report_dict(command, config_dict(args), machine, results)
    write_document(args.out, report, indent=2)
    logger.info("wrote %s; worker logs in %s; done in %.0f s", args.out, args.log_dir, time.monotonic() - started_s)
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
