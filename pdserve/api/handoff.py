"""The P->D handoff of one request, cut into named components: the record, its math and its wire form.

Invariant: every component is a duration measured between two readings of ONE process's monotonic clock;
clocks of different processes are never compared. P sends its own components to the proxy in its leg
answer (`kv_transfer_params.handoff_s`); the proxy adds its own and logs one line per request. The
component names are a fixed set, so they may be metric label values. Torch-free (the proxy imports it).

    proxy      arrival ─ proxy_hop ─▶ leg 1 ───────────────────────────▶ answer ─ proxy_hop ─▶ leg 2 ──▶ ...
    P                           arrival ─ p_queue ─▶ scheduled ─ p_compute ─▶ token 1 ─ p_pin ─▶ pinned
    D                                                                   arrival ─ d_ticket ─▶ ticket claimed
                                                    source verified ─ d_admit ─▶ READ start ─ d_pull ─▶ landed
                                                                  token 1 sent ─ d_first_step ─▶ token 2 sent
    proxy      ... leg 2 sent ─ decode_first_byte ─▶ D's first byte ─ client_first_byte ─▶ written to client
    (prefill_overhead: P's leg as the proxy timed it, less P's three parts: the wire, HTTP, tokenizing, answering)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Measured on P and returned in its leg answer.
PREFILL_COMPONENTS = ("p_queue", "p_compute", "p_pin")
# Measured on D (its own /metrics only).
DECODE_COMPONENTS = ("d_ticket", "d_admit", "d_pull", "d_first_step")
# Measured on the proxy.
PROXY_COMPONENTS = ("proxy_hop", "prefill_overhead", "decode_first_byte", "client_first_byte")
# The proxy's log line and histogram: its own components and P's, in the order a request meets them.
PROXY_LOG_COMPONENTS = ("proxy_hop", "p_queue", "p_compute", "p_pin", "prefill_overhead", "decode_first_byte",
                        "client_first_byte")
# Every component, in the order a P/D request meets them (the order of log fields).
COMPONENTS = ("proxy_hop", "p_queue", "p_compute", "p_pin", "prefill_overhead", "d_ticket", "d_admit", "d_pull",
              "d_first_step", "decode_first_byte", "client_first_byte")
# Buckets fine around the handoff budget (15 ms) and wide enough for a prompt queued for minutes.
HANDOFF_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 120.0,
)
_MAX_WIRE_S = 86400.0  # a day: anything longer on the wire is not a duration of one leg


def elapsed_s(start_s: Optional[float], end_s: Optional[float]) -> Optional[float]:
    """end - start on one clock, never negative; None when either reading is missing."""
    if start_s is None or end_s is None:
        return None
    return max(0.0, end_s - start_s)


def prefill_parts(arrival_s: float, first_scheduled_s: Optional[float], first_token_s: Optional[float],
                  pinned_s: float) -> dict[str, float]:
    """P's components from its own readings (all on P's monotonic clock): only those it has."""
    parts = {"p_queue": elapsed_s(arrival_s, first_scheduled_s),
             "p_compute": elapsed_s(first_scheduled_s, first_token_s),
             "p_pin": elapsed_s(first_token_s, pinned_s)}
    return {name: value for name, value in parts.items() if value is not None}


def parse_prefill_parts(raw: Any) -> dict[str, float]:
    """P's components as they came back in `kv_transfer_params.handoff_s`: known names with finite,
    non-negative numbers of at most a day are kept, anything else dropped (the field is informative: a
    peer that sends none, or garbage, costs the request nothing but its log fields)."""
    if not isinstance(raw, Mapping):
        return {}
    parts = {}
    for name in PREFILL_COMPONENTS:
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and 0.0 <= value <= _MAX_WIRE_S:
            parts[name] = float(value)
    return parts


@dataclass(slots=True)
class ProxyHandoff:
    """The proxy's record of one request's handoff, filled as its legs run (perf_counter seconds, the
    proxy's clock only) and P's reported components added as they arrive."""

    arrival_s: float
    prefill_sent_s: Optional[float] = None  # the first prefill leg went out
    prefill_answered_s: Optional[float] = None  # the last prefill leg's answer was in
    decode_sent_s: Optional[float] = None  # the decode leg (that answered) went out
    decode_first_byte_s: Optional[float] = None  # its first byte arrived (headers, for a stream)
    client_first_byte_s: Optional[float] = None  # the proxy wrote the first byte to the client
    prefill_leg_s: Optional[float] = None  # the last prefill leg, send to answer
    prefill_reported: dict[str, float] = field(default_factory=dict)  # P's own, from its answer

    def prefill_answered(self, leg_s: float, now_s: float, reported: Mapping[str, float]) -> None:
        self.prefill_leg_s = leg_s
        self.prefill_answered_s = now_s
        self.prefill_reported = dict(reported)

    def parts(self) -> dict[str, float]:
        """The components this record can tell, by name (PROXY_LOG_COMPONENTS order); P's missing ones
        (an older P, a decode-only request) are simply absent."""
        hop = elapsed_s(self.arrival_s, self.prefill_sent_s or self.decode_sent_s)
        between = elapsed_s(self.prefill_answered_s, self.decode_sent_s) if self.prefill_sent_s is not None else 0.0
        parts: dict[str, Optional[float]] = {"proxy_hop": None if hop is None or between is None else hop + between}
        parts.update(self.prefill_reported)
        if self.prefill_leg_s is not None and len(self.prefill_reported) == len(PREFILL_COMPONENTS):
            parts["prefill_overhead"] = max(0.0, self.prefill_leg_s - sum(self.prefill_reported.values()))
        parts["decode_first_byte"] = elapsed_s(self.decode_sent_s, self.decode_first_byte_s)
        parts["client_first_byte"] = elapsed_s(self.decode_first_byte_s, self.client_first_byte_s)
        return {name: parts[name] for name in PROXY_LOG_COMPONENTS if parts.get(name) is not None}


def log_fields(parts: Mapping[str, float]) -> str:
    """`name=milliseconds` pairs for one log line, in the fixed component order."""
    return " ".join(f"{name}_ms={parts[name] * 1000:.3f}" for name in COMPONENTS if name in parts)
