"""Frozen configuration of the routing proxy, one sub-config per component.

Built once by `proxy.cli` (or a test) and passed down; nothing reads flags or
environment variables after start-up. Backend URLs are normalised here, so
every other module can compare them as plain strings.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The same bounds, defaults and flags as every worker's: a request the proxy
# accepts is one the workers accept (pdserve/api/validation.py).
from pdserve.api.config import LimitsConfig, check_token

PolicyName = Literal["round_robin", "least_loaded", "prefix", "kv_aware"]


def normalize_url(url: str) -> str:
    """'127.0.0.1:8100' or 'http://h:1/' -> 'http://127.0.0.1:8100' / 'http://h:1'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL must be http(s): {url!r}")
    return url


def split_host_port(target: str) -> tuple[str, int]:
    """'pd-prefill.ns.svc:8100' -> ('pd-prefill.ns.svc', 8100)."""
    host, sep, port = target.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RoutingConfig(_Frozen):
    prefill_policy: PolicyName = "least_loaded"
    decode_policy: PolicyName = "least_loaded"
    # Prefix-aware: how much of the prompt names a prefix, and how busy the
    # preferred worker may be (queued + running requests) before load wins.
    prefix_chars: int = Field(256, ge=1)
    prefix_max_load: int = Field(8, ge=1)
    # Conditional disaggregation: prompts estimated under this many tokens skip
    # the prefill worker (0 = always disaggregate). The proxy has no tokenizer:
    # text is estimated as len(chars) / chars_per_token; token-id prompts are exact.
    disagg_min_prompt_tokens: int = Field(0, ge=0)
    chars_per_token: float = Field(4.0, gt=0)
    # 0 = no cap; otherwise a backend with this many proxy requests in flight is saturated.
    max_in_flight_per_backend: int = Field(0, ge=0)
    # kv_aware (proxy/routing/policies_kv.py): one unit of load costs as much as computing this many prompt tokens.
    kv_load_tokens: float = Field(128.0, ge=0)
    # kv_aware: a cached token the worker must first load from its offload tier is worth this share of one
    # already on its device (a copy and a wait, far cheaper than computing it): below a device hit, above a miss.
    kv_offload_hit_weight: float = Field(0.5, gt=0, lt=1)
    # Cache-aware disaggregation: with a kv_aware decode policy, skip the prefill leg when the chosen
    # decode worker's cache leaves at most this many prompt tokens for it to compute (0 = never).
    kv_decode_only_max_tokens: int = Field(64, ge=0)
    # adaptive: per request, P/D or prefill on the decode worker, from live load against the SLO
    # (proxy/routing/disaggregation.py), the static threshold above until speeds are measured;
    # static: the threshold alone (the default until the goodput sweep has measured adaptive).
    disaggregation: Literal["adaptive", "static"] = "static"
    # adaptive: how many TPOT budgets of stall a decode worker's running streams may absorb
    # while it prefills a prompt itself.
    decode_stall_tpots: float = Field(10.0, ge=0)
    # Peer hints (proxy/routing/peer_hints.py): a prefill leg to a worker that holds at least this many fewer
    # prompt tokens on its device than another prefill worker names that worker, so it may pull the prefix.
    peer_pull: bool = True
    peer_pull_margin_tokens: int = Field(64, ge=1)


class SloConfig(_Frozen):
    """The latency objective requests are judged by (and adaptive disaggregation aims at)."""

    ttft_ms: float = Field(1000.0, ge=0)
    ttft_ms_per_token: float = Field(2.0, ge=0)  # added per prompt token: long prompts may take longer
    tpot_ms: float = Field(20.0, gt=0)


class HealthConfig(_Frozen):
    interval_s: float = Field(1.0, gt=0)  # GET /load on every backend this often
    timeout_s: float = Field(1.0, gt=0)
    unhealthy_after: int = Field(1, ge=1)  # consecutive failed polls before a backend is out
    breaker_failures: int = Field(3, ge=1)  # consecutive request failures that open the breaker
    breaker_cooldown_s: float = Field(5.0, gt=0)  # open -> half-open (one trial request) after this


class TimeoutConfig(_Frozen):
    connect_s: float = Field(2.0, gt=0)
    prefill_s: float = Field(120.0, gt=0)  # the whole prefill leg (its answer comes in one piece)
    decode_s: float = Field(120.0, gt=0)  # to decode's first byte, and between any two bytes after
    write_s: float = Field(30.0, gt=0)
    pool_s: float = Field(10.0, gt=0)  # waiting for a free connection to a backend
    client_send_s: float = Field(30.0, gt=0)  # a streaming client that takes nothing this long is dropped


class DiscoveryConfig(_Frozen):
    # HOST:PORT of a DNS name with one address per worker (a Kubernetes headless service).
    prefill_dns: Optional[str] = None
    decode_dns: Optional[str] = None
    interval_s: float = Field(10.0, gt=0)
    scheme: Literal["http", "https"] = "http"

    @field_validator("prefill_dns", "decode_dns")
    @classmethod
    def _check_target(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            split_host_port(value)
        return value


class ProxyConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    internal_token: Optional[str] = None  # sent to workers as X-Pdserve-Internal-Token; unlocks /health details
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    slo: SloConfig = SloConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    limits: LimitsConfig = LimitsConfig()
    max_prefill_attempts: int = Field(3, ge=1)  # prefill legs tried per request (on distinct workers)
    max_decode_attempts: int = Field(2, ge=1)  # decode workers tried when one refuses before starting
    # When no prefill worker can take a request (none healthy, or every one tried failed), a decode
    # worker computes the prompt itself instead of the client getting a 503 (counted).
    colocated_fallback: bool = True
    # Send the decode leg with the prefill leg: D parses and tokenizes while P computes, and P's answer is
    # delivered to it (proxy/both_legs.py). Off: the decode leg goes out once P answered.
    concurrent_legs: bool = True
    # A streamed request's token 1 goes to the client as soon as P answered (P builds its events), before
    # D's stream starts; D's same events are stripped from its stream (proxy/early_stream.py).
    early_first_token: bool = True
    retry_after_s: int = Field(2, ge=1)  # the Retry-After of a 503
    max_connections_per_backend: int = Field(1024, ge=1)
    log_level: str = "info"

    @field_validator("prefill_urls", "decode_urls", mode="before")
    @classmethod
    def _normalize(cls, value: object) -> object:
        if isinstance(value, (list, tuple)):
            return tuple(dict.fromkeys(normalize_url(str(url)) for url in value))
        return value

    @field_validator("internal_token")
    @classmethod
    def _token_not_empty(cls, token: Optional[str]) -> Optional[str]:
        return check_token(token)

    @model_validator(mode="after")
    def _check_backends(self) -> "ProxyConfig":
        if not self.decode_urls and self.discovery.decode_dns is None:
            raise ValueError("at least one decode backend is needed (--decode URL or --decode-dns HOST:PORT)")
        return self

    @property
    def has_prefill(self) -> bool:
        """Without any prefill backend the proxy load-balances decode workers only."""
        return bool(self.prefill_urls) or self.discovery.prefill_dns is not None
