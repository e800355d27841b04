"""Engine benchmark (`python -m bench.engine`): pdserve (quantized and fp32) against llama.cpp's
`llama-server`, `transformers` generate and `transformers serve`, plus the roofline and the TTFT of a
1,024-token prompt. Invariant: all systems run the same weights, prompts and output lengths, one at
a time, interleaved per concurrency level so outside load hits one level, not one system.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from typing import Optional, Protocol, Sequence

import httpx
import torch

from bench.engine import peers
from bench.lib.machine import CpuMeter, wait_for_quiet
from bench.lib.machine import machine_info as lib_machine_info
from bench.engine.llama_server import LlamaBenchSystem, LlamaServerSystem
from bench.engine.systems import IGNORE_EOS_BODY, BenchError, HttpSystem, HttpTarget, Messages
from bench.lib.launch import REPO_ROOT, ServerProcess, free_port, pdserve_argv
from bench.engine.report import (
    SUBJECT, SUBJECT_COMPILED, SUBJECT_FP32, SYSTEM_ORDER, BenchReport, LongPromptResult, PhaseResult, check_targets,
    format_long_prompts, format_roofline, format_table, format_targets, write_json,
)
from bench.engine.roofline import gguf_matmul_bytes, measure_roofline
from bench.engine.workload import Workload, full_workload, long_prompt_messages, quick_workload

logger = logging.getLogger("bench.engine")

_READY_TIMEOUT_S = 600.0  # a first start may compile pdserve's kernels and decode step
# Room for 16 concurrent requests several times over; explicit so the pool
# (and the peers', sized to match) does not depend on a memory default.
_PDSERVE_NUM_BLOCKS = 1024
_PDSERVE_BLOCK_TOKENS = 16
_KV_TOKENS = _PDSERVE_NUM_BLOCKS * _PDSERVE_BLOCK_TOKENS
_NOISY_FOREIGN_FRACTION = 0.10  # wait for less than this before a phase
_RETRY_FOREIGN_FRACTION = 0.25  # run a phase again when other processes took more than this during it
SYSTEM_CHOICES = ("generate", "serve", "llama-bench", "llama-server", "pdserve", "pdserve-fp32", "pdserve-compiled")


class System(Protocol):
    name: str

    @property
    def pids(self) -> list[int]: ...
    def start(self, ready_timeout_s: float) -> None: ...
    def warm_up(self, indices: Sequence[int], concurrencies: Sequence[int], max_tokens: int) -> None: ...
    def prepare(self, concurrency: int) -> None: ...
    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult: ...
    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]: ...
    def close(self) -> None: ...


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short outputs and few requests, for iterating")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where pdserve and transformers run (llama-server is built for the CPU only)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "engine.json"))
    parser.add_argument("--hf-dir", default=None,
                        help="keep the dequantized Hugging Face copy here and reuse it on later runs")
    parser.add_argument("--llama-server", default=None, help="use this llama-server binary instead of building one")
    parser.add_argument("--llama-bench", default=None, help="use this llama-bench binary instead of building one")
    parser.add_argument("--settle-s", type=float, default=15.0,
                        help="before each phase, wait up to this long for other processes to go quiet")
    parser.add_argument("--retries", type=int, default=1,
                        help="run a phase again (at most this often) when the machine was busy during it")
    parser.add_argument("--skip", action="append", default=[], choices=SYSTEM_CHOICES,
                        help="leave a system out (repeatable)")
    parser.add_argument("--concurrency", type=int, action="append", default=[],
                        help="run only this concurrency level (repeatable; default: every level)")
    parser.add_argument("--skip-long-prompts", action="store_true",
                        help="leave out the time to first token of long prompts")
    return parser.parse_args(argv)


def machine_info(device: str) -> dict:
    import transformers

    machine = lib_machine_info()
    machine["load_average_at_start"] = machine.pop("load_average")
    return machine | {"torch_threads": torch.get_num_threads(), "device": device, "cuda": torch.cuda.is_available(),
                      "torch": torch.__version__, "transformers": transformers.__version__}


def pdserve_system(name: str, extra_args: Sequence[str], device: str, log_dir: str) -> HttpSystem:
    port = free_port()
    argv = pdserve_argv("serve", port, "--host", "127.0.0.1", "--device", device, "--num-blocks",
                        str(_PDSERVE_NUM_BLOCKS), "--block-size", str(_PDSERVE_BLOCK_TOKENS), "--log-level", "warning",
                        *extra_args)
    log_path = os.path.join(log_dir, name.replace(" ", "_") + ".log")
    server = ServerProcess(name, argv, port, log_path, ready="health", own_session=True)

    return HttpSystem(server, lambda started: HttpTarget(started.base_url, started.model_id(), IGNORE_EOS_BODY))


def serve_system(hf_dir: str, device: str, log_dir: str) -> HttpSystem:
    port = free_port()
    argv = peers.transformers_serve_argv(hf_dir, port, num_kv_tokens=_KV_TOKENS, device=device)
    log_path = os.path.join(log_dir, "transformers-serve.log")
    server = ServerProcess(peers.SERVE_SYSTEM, argv, port, log_path, env=peers.transformers_serve_env(),
                           ready="health", own_session=True)
    # It serves the model under the name it was started with; /v1/models scans the hub cache instead.
    return HttpSystem(server, lambda s: HttpTarget(s.base_url, hf_dir, peers.transformers_serve_extra_body()))


def workload_levels(args: argparse.Namespace) -> Sequence[int]:
    return args.concurrency or (quick_workload() if args.quick else full_workload()).concurrencies


def candidate_systems(args: argparse.Namespace, gguf_path: str, hf_dir: str, work_dir: str) -> list[System]:
    candidates: list[System] = []
    if "generate" not in args.skip:
        candidates.append(peers.GenerateSystem(hf_dir, args.device))
    if "serve" not in args.skip:
        candidates.append(serve_system(hf_dir, args.device, work_dir))
    if "llama-bench" not in args.skip and args.device == "cpu" and 1 in workload_levels(args):
        candidates.append(LlamaBenchSystem(gguf_path, args.llama_bench))
        candidates.append(LlamaBenchSystem(gguf_path, args.llama_bench, repack=False))
    if "llama-server" not in args.skip and args.device == "cpu":
        candidates.append(LlamaServerSystem(gguf_path, work_dir, _KV_TOKENS, args.llama_server))
    if "pdserve-fp32" not in args.skip:
        candidates.append(pdserve_system(SUBJECT_FP32, ["--dtype", "float32"], args.device, work_dir))
    if "pdserve" not in args.skip:
        candidates.append(pdserve_system(SUBJECT, [], args.device, work_dir))
    if "pdserve-compiled" not in args.skip:
        candidates.append(pdserve_system(SUBJECT_COMPILED, ["--compile"], args.device, work_dir))
    return candidates


def start_systems(systems: Sequence[System], workload: Workload, report: BenchReport) -> list[System]:
    """Start and warm up each system; one that fails gets error rows and is left out."""
    ready = []
    warmup = workload.warmup_indices(max(workload.concurrencies))
    for system in systems:
        try:
            started_s = time.monotonic()
            system.start(_READY_TIMEOUT_S)
            report.machine.setdefault("start_s", {})[system.name] = round(time.monotonic() - started_s, 1)
            system.warm_up(warmup, workload.concurrencies, workload.num_warmup_tokens)
            ready.append(system)
        except (BenchError, httpx.HTTPError, OSError) as exc:
            logger.error("%s could not start: %s", system.name, exc)
            system.close()
            report.results += [PhaseResult(system=system.name, concurrency=c, error=str(exc)[:300])
                               for c in workload.concurrencies]
    return ready


def _measure_once(system: System, workload: Workload, concurrency: int, settle_s: float,
                  attempt: int) -> PhaseResult:
    try:
        system.prepare(concurrency)
    except (BenchError, httpx.HTTPError, OSError) as exc:
        return PhaseResult(system=system.name, concurrency=concurrency, error=str(exc)[:300])
    if settle_s > 0:
        before = wait_for_quiet(system.pids, _NOISY_FOREIGN_FRACTION, settle_s)
        if before is not None and before >= _NOISY_FOREIGN_FRACTION:
            logger.warning("other processes still use %.0f%% of the CPUs after %.0f s; measuring anyway",
                           before * 100, settle_s)
    meter = CpuMeter(system.pids)
    meter.start()
    try:
        result = system.run(workload.prompt_indices(concurrency, attempt), concurrency, workload.max_tokens)
    except (BenchError, httpx.HTTPError) as exc:
        logger.error("%s failed at c=%d: %s", system.name, concurrency, exc)
        return PhaseResult(system=system.name, concurrency=concurrency, error=str(exc)[:300],
                           dropped_connection=str(exc).startswith("RemoteProtocolError")
                           or isinstance(exc, httpx.RemoteProtocolError))
    result.foreign_cpu_fraction = meter.foreign_fraction()
    logger.info("%s c=%d: %.1f tok/s, TTFT p50 %.0f ms, other processes used %s of the CPUs",
                system.name, concurrency, result.output_tokens_per_s, (result.ttft_p50_s or 0) * 1000,
                "?" if result.foreign_cpu_fraction is None else f"{result.foreign_cpu_fraction:.0%}")
    return result


def measure_phase(system: System, workload: Workload, concurrency: int, settle_s: float,
                  num_retries: int) -> PhaseResult:
    """One phase, run again (on fresh prompts) when other processes took a large share of the
    CPUs meanwhile; the row keeps the attempt that ran on the quieter machine."""
    kept: Optional[PhaseResult] = None
    for attempt in range(num_retries + 1):
        result = _measure_once(system, workload, concurrency, settle_s, attempt)
        if result.error is not None:
            # A server that dropped a connection without answering (llama-server did, right after
            # a restart, in two runs) gets the phase again on fresh prompts; other errors stand.
            if result.dropped_connection and attempt < num_retries:
                logger.warning("%s c=%d: a connection dropped unanswered; running the phase again",
                               system.name, concurrency)
                continue
            return result
        if kept is None or (result.foreign_cpu_fraction or 0) < (kept.foreign_cpu_fraction or 0):
            kept = result
        if (result.foreign_cpu_fraction or 0) <= _RETRY_FOREIGN_FRACTION:
            break
        logger.warning("%s c=%d ran on a busy machine%s", system.name, concurrency,
                       "; running it again" if attempt < num_retries else ": treat it with care")
    kept.num_attempts = attempt + 1
    return kept


def long_prompt_lines(gguf_path: str, num_tokens: int) -> tuple[int, int]:
    """(log lines, chat-templated prompt tokens): the fewest lines that reach `num_tokens`."""
    from pdserve.models.gguf_file import GGUFCheckpoint
    from pdserve.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_vocab(GGUFCheckpoint(gguf_path).vocab())
    count = lambda lines: len(tokenizer.encode(  # noqa: E731
        tokenizer.apply_chat_template(long_prompt_messages(0, lines)), add_special_tokens=False))
    lines = 1
    while count(lines) < num_tokens:
        lines += 1
    return lines, count(lines)


def measure_long_prompts(systems: Sequence[System], workload: Workload, gguf_path: str) -> list[LongPromptResult]:
    lines, num_tokens = long_prompt_lines(gguf_path, workload.long_prompt_tokens)
    messages = partial(long_prompt_messages, num_lines=lines)
    results = []
    for system in systems:
        try:
            times = system.first_token_times(workload.long_prompt_indices(), messages)
            results.append(LongPromptResult(system.name, num_tokens, times))
        except (BenchError, httpx.HTTPError, OSError) as exc:
            logger.warning("%s: the long-prompt phase failed: %s", system.name, exc)  # whole, the table cuts it
            results.append(LongPromptResult(system.name, num_tokens, error=str(exc)[:300]))
        logger.info("%s: TTFT of %d-token prompts: %s", system.name, num_tokens, results[-1].ttft_s)
    return results


def run_all(args: argparse.Namespace, workload: Workload, work_dir: str, report: BenchReport) -> None:
    from pdserve.models.loader import embedded_model_path

    gguf_path = embedded_model_path()
    hf_dir = args.hf_dir or os.path.join(work_dir, "smollm2-hf")
    peers.prepare_hf_dir(gguf_path, hf_dir)
    systems = start_systems(candidate_systems(args, gguf_path, hf_dir, work_dir), workload, report)
    try:
        generate = next((s for s in systems if isinstance(s, peers.GenerateSystem)), None)
        if generate is not None:  # the roofline needs the model's weights in this process
            report.roofline = measure_roofline(generate.model, max(workload.concurrencies),
                                               gguf_matmul_bytes(gguf_path))
            logger.info("%s", format_roofline(report.roofline))
        for concurrency in workload.concurrencies:
            report.results += [measure_phase(system, workload, concurrency, args.settle_s, args.retries)
                               for system in systems if concurrency == 1 or not isinstance(system, LlamaBenchSystem)]
        if not args.skip_long_prompts:
            servers = [system for system in systems if not isinstance(system, LlamaBenchSystem)]
            report.long_prompts = measure_long_prompts(servers, workload, gguf_path)
    finally:
        for system in systems:
            if isinstance(system, LlamaServerSystem) and system.repack_off_reason:
                report.machine["llama_server_without_repack"] = system.repack_off_reason
            system.close()


def only_levels(workload: Workload, levels: Sequence[int]) -> Workload:
    """The workload cut to these concurrency levels; SystemExit naming a level it does not have."""
    unknown = set(levels) - set(workload.concurrencies)
    if unknown:
        raise SystemExit(f"no phase at concurrency {sorted(unknown)}; the workload has {list(workload.concurrencies)}")
    kept = {c: n for c, n in workload.num_requests_by_concurrency.items() if c in levels}
    return dataclasses.replace(workload, num_requests_by_concurrency=kept)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    workload = quick_workload() if args.quick else full_workload()
    if args.concurrency:
        workload = only_levels(workload, args.concurrency)
    command = " ".join(["python3", "bench/engine.py", *(argv if argv is not None else sys.argv[1:])])
    report = BenchReport(command=command, machine=machine_info(args.device), workload=asdict(workload))
    started_s = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as work_dir:
        run_all(args, workload, work_dir, report)
    order = {name: i for i, name in enumerate(SYSTEM_ORDER)}
    report.results.sort(key=lambda r: (r.concurrency, order.get(r.system, len(order))))
    report.machine["load_average_at_end"] = os.getloadavg()
    report.machine["bench_wall_s"] = round(time.monotonic() - started_s, 1)
    write_json(report, args.out)
    print(format_table(report.results, report.roofline))
    if report.roofline is not None:
        print(format_roofline(report.roofline))
    print(format_long_prompts(report.long_prompts))
    print(format_targets(check_targets(report.results)))
    if "llama_server_without_repack" in report.machine:
        print(f"llama-server ran without repacked weights: {report.machine['llama_server_without_repack']}")
    print(f"wrote {args.out} in {report.machine['bench_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
