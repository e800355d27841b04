"""Prometheus metrics of the proxy (`pdserve_proxy_*`), on a registry of its own.

No globals: each `ProxyMetrics` owns its `CollectorRegistry`. Labels are of low
cardinality: a role, a backend URL (one per worker), a reason, a status class;
never a request id. Backend state gauges are read from the live pools at
scrape time, so a backend that discovery removed simply disappears.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.api.handoff import HANDOFF_BUCKETS_S

from proxy.backends import Backend

# A proxy leg or its overhead ranges from tens of microseconds (the proxy's own
# work) to minutes (a long prompt queued behind others).
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def status_class(status_code: int) -> str:
    return f"{status_code // 100}xx"


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter(
            "pdserve_proxy_requests_total", "Client requests answered, by route mode and status class",
            ["mode", "status"], registry=registry)
        self.backend_requests = Counter(
            "pdserve_proxy_backend_requests_total", "Requests sent to a backend, by status class (or 'error')",
            ["role", "backend", "status"], registry=registry)
        self.backend_errors = Counter(
            "pdserve_proxy_backend_errors_total", "Failed requests to a backend, by reason",
            ["role", "backend", "reason"], registry=registry)
        self.backend_server_errors = Counter(
            "pdserve_proxy_backend_server_errors_total",
            "5xx answers a worker gave about one request, passed to the client unchanged (they never open a "
            "breaker: the worker answered), by status code", ["role", "backend", "status"], registry=registry)
        self.retries = Counter(
            "pdserve_proxy_retries_total", "Legs re-sent to another backend, by role and reason",
            ["role", "reason"], registry=registry)
        self.disaggregation = Counter(
            "pdserve_proxy_disaggregation_decisions_total",
            "Where requests' prompts were computed (prefill: a prefill worker, P/D; decode: the decode worker "
            "itself), by the reason the adaptive policy gave", ["where", "reason"], registry=registry)
        self.slo_requests = Counter(
            "pdserve_proxy_slo_requests_total",
            "Streamed requests judged against the SLO, by result (met, ttft_missed, tpot_missed)",
            ["result"], registry=registry)
        self.slo_attainment = Gauge(
            "pdserve_proxy_slo_attainment_ratio",
            "Share of the last judged streamed requests that met the SLO (1 before any)", registry=registry)
        self.slo_attainment.set(1.0)
        self.colocated_fallbacks = Counter(
            "pdserve_proxy_colocated_fallbacks_total",
            "Requests a decode worker computed alone because no prefill worker could take them, by reason "
            "(no_prefill: none was available; prefill_failed: every one tried failed)",
            ["reason"], registry=registry)
        self.rejected = Counter(
            "pdserve_proxy_rejected_total", "503s because no backend of a role was available",
            ["role"], registry=registry)
        self.pd_legs_recomputed = Counter(
            "pdserve_proxy_pd_legs_recomputed_total",
            "P/D decode legs whose prompt the decode worker computed itself after all (it said so in its "
            "X-Pdserve-KV-Recomputed header: pull failed, stale ticket, prompt mismatch): prefill work wasted",
            registry=registry)
        self.concurrent_legs = Counter(
            "pdserve_proxy_concurrent_legs_total",
            "Decode legs sent with their prefill leg, by outcome (delivered: P's answer reached the waiting "
            "decode worker; called_off: P failed or the client left first; in_turn: the decode worker failed, "
            "refused or missed its ticket, and the legs went on in turn)",
            ["outcome"], registry=registry)
        self.early_first_token = Counter(
            "pdserve_proxy_early_first_token_total",
            "Streamed P/D requests whose prefill leg was asked for token 1's events, by outcome (sent: the "
            "client got token 1 from P's answer; not_offered: P gave none, D streams token 1, reason as P "
            "named it: n_choices, echo, grammar, ends_at_one, held_back, or unnamed; mismatch: D's first "
            "events differed, the stream ended with an error event; decode_failed: the decode leg failed "
            "after token 1 was sent, the stream ended with an error event)",
            ["outcome", "reason"], registry=registry)
        self.kv_releases = Counter(
            "pdserve_proxy_kv_releases_total",
            "Prefills whose pinned KV the proxy asked their prefill worker to free (the decode leg failed or "
            "was refused), by result: sent, failed (the release call failed; the lease frees it) or skipped",
            ["result"], registry=registry)
        self.backend_latency_s = Histogram(
            "pdserve_proxy_backend_latency_seconds",
            "Backend answer time: the whole prefill leg; decode until its first byte",
            ["role", "backend"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.handoff_s = Histogram(
            "pdserve_proxy_handoff_seconds",
            "Per-request handoff components (docs/metrics.md): the proxy's own (proxy_hop, prefill_overhead, "
            "decode_first_byte, client_first_byte) and those the prefill worker reported (p_queue, p_compute, "
            "p_pin), by route mode", ["mode", "component"], buckets=HANDOFF_BUCKETS_S, registry=registry)
        self._init_ttft(registry)

    def _init_ttft(self, registry: CollectorRegistry) -> None:
        # The client-visible TTFT of a streamed request = prefill leg + decode's
        # transfer-and-first-token + the proxy's own overhead.
        self.ttft_s = Histogram(
            "pdserve_proxy_ttft_seconds", "Client-visible time to first byte of a streamed answer",
            ["mode"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.ttft_prefill_s = Histogram(
            "pdserve_proxy_ttft_prefill_seconds", "TTFT share: the prefill leg, retries included",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.ttft_decode_s = Histogram(
            "pdserve_proxy_ttft_decode_first_token_seconds",
            "TTFT share: decode leg until its first byte (KV transfer + first token)",
            ["mode"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.overhead_s = Histogram(
            "pdserve_proxy_overhead_seconds",
            "Time to first byte minus the time spent waiting on backends (every request)",
            ["mode"], buckets=LATENCY_BUCKETS_S, registry=registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BackendStateCollector(Collector):
    """Health, breaker state and in-flight requests of every backend currently known."""

    def __init__(self, list_backends: Callable[[], Iterable[Backend]]):
        self._list_backends = list_backends

    def collect(self):
        healthy = GaugeMetricFamily("pdserve_proxy_backend_healthy", "1 if the last health poll said ready",
                                    labels=["role", "backend"])
        breaker = GaugeMetricFamily("pdserve_proxy_backend_breaker_state",
                                    "Circuit breaker: 0 closed, 1 half-open, 2 open", labels=["role", "backend"])
        in_flight = GaugeMetricFamily("pdserve_proxy_backend_in_flight_requests",
                                      "Requests the proxy has outstanding on the backend", labels=["role", "backend"])
        for backend in self._list_backends():
            labels = [backend.role.value, backend.url]
            healthy.add_metric(labels, 1.0 if backend.healthy else 0.0)
            breaker.add_metric(labels, float(backend.breaker.state))
            in_flight.add_metric(labels, float(backend.num_in_flight))
        return [healthy, breaker, in_flight]


def create_proxy_metrics(list_backends: Callable[[], Iterable[Backend]]) -> ProxyMetrics:
    registry = CollectorRegistry(auto_describe=False)
    metrics = ProxyMetrics(registry)
    registry.register(BackendStateCollector(list_backends))
    return metrics
