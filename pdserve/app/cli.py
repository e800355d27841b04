"""Command line: `pdserve serve|prefill|decode|proxy|up`.

Parses flags into frozen configs and hands them to the composition roots;
no logic of its own beyond that.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from pdserve.api.flags import ConfigError, add_worker_flags, worker_config
from pdserve.app.local_cluster import add_up_arguments, run_local_cluster
from proxy.cli import add_proxy_arguments, run_proxy

_ROLES = {"serve": "colocated", "prefill": "prefill", "decode": "decode"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "one colocated worker: the OpenAI API, no KV transfer"),
        ("prefill", "prefill worker: computes prompts' KV and keeps it for decode workers"),
        ("decode", "decode worker: pulls prompts' KV from prefill workers over NIXL, then generates"),
    ):
        add_worker_flags(commands.add_parser(name, help=help_text), _ROLES[name])
    add_proxy_arguments(commands.add_parser("proxy", help="routing proxy: the OpenAI endpoint in front of the workers"))
    add_up_arguments(commands.add_parser("up", help="local cluster: one prefill, one decode and the proxy"))
    return parser


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
    try:
        config = worker_config(args, _ROLES[args.command])
    except ConfigError as error:
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    if not config.parallel.is_leader:  # a rank started as its own command (another host): no HTTP server
        from pdserve.runner.tensor_parallel import serve_follower

        return serve_follower(config)
    from pdserve.app.worker import serve_worker  # heavy imports (torch) only when serving

    return serve_worker(config)


if __name__ == "__main__":
    sys.exit(main())
