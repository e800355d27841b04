"""Command line of `pdserve proxy`: flags -> `ProxyConfig` -> uvicorn.

Importing this module is cheap (argparse and pydantic only): `pdserve/app/cli.py`
builds its parser from it, and the server stack is imported only to run.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

from pydantic import ValidationError

from pdserve.api.config import LimitsConfig
from pdserve.api.flags import add_flags, section_flag_specs, section_values
from proxy.config import DiscoveryConfig, HealthConfig, ProxyConfig, RoutingConfig, SloConfig, TimeoutConfig

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "prefix", "kv_aware")
LIMIT_FLAGS = section_flag_specs("limits", LimitsConfig)
INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"  # the workers read the same variable


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    backends = parser.add_argument_group("backends")
    backends.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                          help="prefill worker URL(s); repeat or list several")
    backends.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                          help="decode worker URL(s); repeat or list several")
    backends.add_argument("--prefill-dns", default=None, metavar="HOST:PORT",
                          help="DNS name resolving to one address per prefill worker (headless service)")
    backends.add_argument("--decode-dns", default=None, metavar="HOST:PORT",
                          help="DNS name resolving to one address per decode worker")
    backends.add_argument("--dns-interval-s", type=float, default=10.0, help="re-resolve DNS names this often")
    backends.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                          help=f"shared token the workers require on kv_transfer_params (default: ${INTERNAL_TOKEN_ENV};"
                               " prefer the variable: flags show in process listings)")
    _add_routing_arguments(parser)
    _add_failure_arguments(parser)
    add_flags(parser, LIMIT_FLAGS)  # the workers' own request bounds, same flags and defaults
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    routing = parser.add_argument_group("routing")
    routing.add_argument("--policy", choices=POLICIES, default=None,
                         help="policy for both roles (default least_loaded)")
    routing.add_argument("--prefill-policy", choices=POLICIES, default=None, help="overrides --policy for prefill")
    routing.add_argument("--decode-policy", choices=POLICIES, default=None, help="overrides --policy for decode")
    routing.add_argument("--prefix-chars", type=int, default=256,
                         help="prefix policy: leading characters of the prompt that name its prefix")
    routing.add_argument("--prefix-max-load", type=int, default=8,
                         help="prefix policy: past this many queued+running requests the least loaded worker wins")
    routing.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                         help="prompts estimated under this many tokens go straight to decode (0: never)")
    routing.add_argument("--chars-per-token", type=float, default=4.0,
                         help="the estimate for text prompts: tokens = ceil(characters / this)")
    routing.add_argument("--max-in-flight-per-backend", type=int, default=0,
                         help="a backend with this many proxy requests in flight is saturated (0: no cap)")
    routing.add_argument("--peer-pull", action=argparse.BooleanOptionalAction, default=True,
                         help="send a prefill worker that holds less of a prompt than another one a hint naming it "
                              "(the worker may pull the prefix from there instead of computing it); with two or more "
                              "prefill workers it follows their KV events whatever the policy")
    routing.add_argument("--peer-pull-margin-tokens", type=int, default=64,
                         help="peer hints: only when the other worker holds at least this many more prompt tokens")
    routing.add_argument("--kv-load-tokens", type=float, default=128.0,
                         help="kv_aware: prompt tokens one unit of load (a queued request) is worth in the score")
    routing.add_argument("--kv-offload-hit-weight", type=float, default=0.5,
                         help="kv_aware: what a cached token in a worker's offload tier is worth against one on its "
                              "device (0 < w < 1: below a device hit, above a miss)")
    routing.add_argument("--kv-decode-only-max-tokens", type=int, default=64,
                         help="kv_aware decode: skip the prefill leg when the decode worker's cache leaves at most "
                              "this many prompt tokens to compute (0: never)")
    routing.add_argument("--disaggregation", choices=("adaptive", "static"), default="static",
                         help="adaptive: per request, P/D or prefill on the decode worker, whichever the live load "
                              "says meets the SLO (--disagg-min-prompt-tokens until speeds are measured); "
                              "static: --disagg-min-prompt-tokens alone")
    routing.add_argument("--decode-stall-tpots", type=float, default=10.0,
                         help="adaptive: TPOT budgets of stall a busy decode worker's streams may absorb while "
                              "it prefills a prompt itself")
    slo = parser.add_argument_group("latency objective (judged on streamed answers)")
    slo.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="time to first token, fixed part")
    slo.add_argument("--slo-ttft-ms-per-token", type=float, default=2.0,
                     help="time to first token, added per prompt token")
    slo.add_argument("--slo-tpot-ms", type=float, default=20.0, help="mean time per output token after the first")


def _add_failure_arguments(parser: argparse.ArgumentParser) -> None:
    failures = parser.add_argument_group("health, failures and timeouts")
    failures.add_argument("--health-interval-s", type=float, default=1.0, help="poll GET /load this often")
    failures.add_argument("--health-timeout-s", type=float, default=1.0)
    failures.add_argument("--unhealthy-after", type=int, default=1, help="failed polls before a backend is out")
    failures.add_argument("--breaker-failures", type=int, default=3,
                          help="consecutive failed requests that open a backend's circuit breaker")
    failures.add_argument("--breaker-cooldown-s", type=float, default=5.0,
                          help="an open breaker lets one trial request through after this long")
    failures.add_argument("--max-prefill-attempts", type=int, default=3)
    failures.add_argument("--max-decode-attempts", type=int, default=2)
    failures.add_argument("--no-colocated-fallback", dest="colocated_fallback", action="store_false",
                          help="answer 503 when no prefill worker can take a request, instead of letting a decode "
                               "worker compute the prompt itself")
    failures.add_argument("--no-concurrent-legs", dest="concurrent_legs", action="store_false",
                          help="send the decode leg only once the prefill leg answered, instead of with it "
                               "(the decode worker then waits for P's answer, which the proxy delivers to it)")
    failures.add_argument("--no-early-first-token", dest="early_first_token", action="store_false",
                          help="stream token 1 from the decode worker, instead of sending P's token 1 to the client "
                               "as soon as the prefill leg answered")
    failures.add_argument("--retry-after-s", type=int, default=2, help="Retry-After of the proxy's 503s")
    failures.add_argument("--connect-timeout-s", type=float, default=2.0)
    failures.add_argument("--prefill-timeout-s", type=float, default=120.0, help="the whole prefill leg")
    failures.add_argument("--decode-timeout-s", type=float, default=120.0,
                          help="decode's first byte, and any gap between two bytes of its stream")
    failures.add_argument("--client-send-timeout-s", type=float, default=30.0,
                          help="drop a streaming client that takes no part of the answer for this long")
    failures.add_argument("--max-connections-per-backend", type=int, default=1024)


def _policy(args: argparse.Namespace, specific: Optional[str]) -> str:
    return specific or args.policy or "least_loaded"


def proxy_config(args: argparse.Namespace) -> ProxyConfig:
    """Flags -> config; raises `ValueError` (pydantic's) with the offending flag's field."""
    return ProxyConfig(
        host=args.host, port=args.port, prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
        internal_token=args.internal_token, log_level=args.log_level,
        routing=RoutingConfig(
            prefill_policy=_policy(args, args.prefill_policy), decode_policy=_policy(args, args.decode_policy),
            prefix_chars=args.prefix_chars, prefix_max_load=args.prefix_max_load,
            disagg_min_prompt_tokens=args.disagg_min_prompt_tokens, chars_per_token=args.chars_per_token,
            max_in_flight_per_backend=args.max_in_flight_per_backend, kv_load_tokens=args.kv_load_tokens,
            kv_offload_hit_weight=args.kv_offload_hit_weight,
            kv_decode_only_max_tokens=args.kv_decode_only_max_tokens, disaggregation=args.disaggregation,
            decode_stall_tpots=args.decode_stall_tpots, peer_pull=args.peer_pull,
            peer_pull_margin_tokens=args.peer_pull_margin_tokens,
        ),
        slo=SloConfig(ttft_ms=args.slo_ttft_ms, ttft_ms_per_token=args.slo_ttft_ms_per_token,
                      tpot_ms=args.slo_tpot_ms),
        health=HealthConfig(
            interval_s=args.health_interval_s, timeout_s=args.health_timeout_s, unhealthy_after=args.unhealthy_after,
            breaker_failures=args.breaker_failures, breaker_cooldown_s=args.breaker_cooldown_s,
        ),
        timeouts=TimeoutConfig(connect_s=args.connect_timeout_s, prefill_s=args.prefill_timeout_s,
                               decode_s=args.decode_timeout_s, client_send_s=args.client_send_timeout_s),
        discovery=DiscoveryConfig(prefill_dns=args.prefill_dns, decode_dns=args.decode_dns,
                                  interval_s=args.dns_interval_s),
        limits=LimitsConfig(**section_values(args, LIMIT_FLAGS)),
        max_prefill_attempts=args.max_prefill_attempts, max_decode_attempts=args.max_decode_attempts,
        colocated_fallback=args.colocated_fallback, concurrent_legs=args.concurrent_legs,
        early_first_token=args.early_first_token,
        retry_after_s=args.retry_after_s, max_connections_per_backend=args.max_connections_per_backend,
    )


def run_proxy(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit status."""
    try:
        config = proxy_config(args)
    except ValidationError as exc:
        logger.error("invalid proxy configuration: %s", exc)
        return 2
    import uvicorn  # the server stack only when serving

    from pdserve.api.http_bounds import http_protocol_with_header_deadline
    from proxy.app import create_app

    if config.log_level != "debug":
        # httpx logs every request at INFO: the health polls alone would flood the log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", config.host, config.port,
                list(config.prefill_urls) or config.discovery.prefill_dns or "none",
                list(config.decode_urls) or config.discovery.decode_dns)
    # uvicorn's access log costs more than the forwarding itself; per-request lines are ours.
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=config.log_level,
                access_log=False, timeout_keep_alive=30,
                http=http_protocol_with_header_deadline(config.limits.header_timeout_s))
    return 0
