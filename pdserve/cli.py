"""Command line: `pdserve serve|prefill|decode|proxy|up`.

Parses flags into frozen configs and hands them to the composition roots;
no logic of its own beyond that.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Optional, Sequence

from pdserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, TransferConfig, WorkerConfig
from pdserve.local_cluster import add_up_arguments, run_local_cluster
from proxy.cli import add_proxy_arguments, run_proxy

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2g', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _add_worker_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", default=None)
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    model.add_argument("--max-model-len", type=int, default=None)
    model.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    model.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="auto: keep a GGUF's Q4_0/Q4_1/Q8_0 weights packed (dequantize all with --dtype float32);"
                            " int8/int4: also quantize float weights at load")
    model.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                       help="compile the decode step (default: on CUDA; on the CPU only when asked)")
    cache = parser.add_argument_group("KV pool")
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument("--num-blocks", type=int, default=None, help="pool size in blocks (wins over --kv-memory)")
    cache.add_argument("--kv-memory", type=parse_bytes, default=1 << 30, help="pool size in bytes (default 1GiB)")
    cache.add_argument("--no-prefix-caching", action="store_true")
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-batched-tokens", type=int, default=512)
    sched.add_argument("--max-num-running", type=int, default=64)
    sched.add_argument("--max-num-waiting", type=int, default=1024)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=default_port)
    server.add_argument("--internal-token", default=os.environ.get("PDSERVE_INTERNAL_TOKEN"),
                        help="shared token guarding internal endpoints (default: $PDSERVE_INTERNAL_TOKEN;"
                             " prefer the variable: flags show in process listings)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="on SIGTERM, wait this long for in-flight work (and pinned KV) before exiting")


def _add_transfer_flags(parser: argparse.ArgumentParser) -> None:
    kv = parser.add_argument_group("P/D KV transfer")
    kv.add_argument("--engine-id", default=None, help="stable worker name (default: role-hostname-port)")
    kv.add_argument("--advertise-host", default=None, help="address peers reach this worker on (default: --host)")
    kv.add_argument("--kv-lease-s", type=float, default=30.0, help="P: keep unread blocks this long")
    kv.add_argument("--kv-heartbeat-s", type=float, default=5.0, help="D: renew leases of queued requests this often")
    kv.add_argument("--kv-pull-timeout-s", type=float, default=30.0, help="D: give up on a KV read after this long")
    kv.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"],
                    help="D: on a failed pull, prefill locally (recompute) or return a distinct 503 (fail)")


def worker_config(args: argparse.Namespace, role: str) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        model=ModelConfig(
            path=args.model, served_name=args.served_model_name, dtype=args.dtype,
            device=args.device, max_model_len=args.max_model_len, num_threads=args.num_threads,
            quantization=args.quantization, compile=args.compile,
        ),
        cache=CacheConfig(
            block_size=args.block_size, num_blocks=args.num_blocks, kv_memory_bytes=args.kv_memory,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_running=args.max_num_running,
            max_num_waiting=args.max_num_waiting,
        ),
        server=ServerConfig(host=args.host, port=args.port, internal_token=args.internal_token,
                            log_level=args.log_level, drain_timeout_s=args.drain_timeout_s),
        transfer=_transfer_config(args),
    )


def _transfer_config(args: argparse.Namespace) -> TransferConfig:
    if not hasattr(args, "kv_lease_s"):
        return TransferConfig()
    return TransferConfig(
        engine_id=args.engine_id, advertise_host=args.advertise_host, lease_s=args.kv_lease_s,
        heartbeat_s=args.kv_heartbeat_s, pull_timeout_s=args.kv_pull_timeout_s, failure_policy=args.kv_failure_policy,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="one colocated worker: the OpenAI API, no KV transfer")
    _add_worker_flags(serve, default_port=8000)
    for name, port, help_text in (
        ("prefill", 8100, "prefill worker: computes prompts' KV and keeps it for decode workers"),
        ("decode", 8200, "decode worker: pulls prompts' KV from prefill workers over NIXL, then generates"),
    ):
        worker = commands.add_parser(name, help=help_text)
        _add_worker_flags(worker, default_port=port)
        _add_transfer_flags(worker)
    add_proxy_arguments(commands.add_parser("proxy", help="routing proxy: the OpenAI endpoint in front of the workers"))
    add_up_arguments(commands.add_parser("up", help="local cluster: one prefill, one decode and the proxy"))
    return parser


_ROLES = {"serve": "colocated", "prefill": "prefill", "decode": "decode"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "proxy":
        return run_proxy(args)  # never imports torch: the proxy ships without it
    if args.command == "up":
        return run_local_cluster(args)
    from pdserve.worker import serve_worker  # heavy imports (torch) only when serving

    serve_worker(worker_config(args, _ROLES[args.command]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
