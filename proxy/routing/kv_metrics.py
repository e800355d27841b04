"""Metrics of KV-aware routing (`pdserve_proxy_kv_*`), on the proxy's own registry.

Labels stay of low cardinality: a role and a reason. The index's sizes are
read from the live index at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.routing.kv_index import KVIndex

# |actual - predicted| cached tokens: 0 when the index is exact; a block or
# two when an eviction raced the request; more means the index is stale.
ERROR_BUCKETS_TOKENS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 4096)


class KVRoutingMetrics:
    def __init__(self, registry: CollectorRegistry, index: KVIndex):
        self.events_applied = Counter(
            "pdserve_proxy_kv_events_applied_total", "KV events applied to the index, by the worker's role",
            ["role"], registry=registry)
        self.resyncs = Counter(
            "pdserve_proxy_kv_resyncs_total",
            "Snapshots that replaced a worker's blocks in the index, by role and reason "
            "(connect, restart = new epoch, gap = lost events, stream = the stream broke)",
            ["role", "reason"], registry=registry)
        self.decisions = Counter(
            "pdserve_proxy_kv_routing_decisions_total",
            "kv_aware routing decisions, by role and reason (cache_hit, load, no_hit, no_blocks; "
            "prefill skipped_decode_cached: the decode worker prefilled alone)",
            ["role", "reason"], registry=registry)
        self.predicted_tokens = Counter(
            "pdserve_proxy_kv_predicted_cached_tokens_total",
            "Cached prompt tokens the index predicted for the chosen worker (requests whose answer was checked)",
            ["role"], registry=registry)
        self.actual_tokens = Counter(
            "pdserve_proxy_kv_actual_cached_tokens_total",
            "Cached prompt tokens the chosen worker reported (usage.prompt_tokens_details.cached_tokens)",
            ["role"], registry=registry)
        self.prediction_error = Histogram(
            "pdserve_proxy_kv_prediction_error_tokens", "|reported - predicted| cached prompt tokens per request",
            ["role"], buckets=ERROR_BUCKETS_TOKENS, registry=registry)
        registry.register(_IndexCollector(index))

    def observe_prediction(self, role: str, predicted: int, actual: int) -> None:
        self.predicted_tokens.labels(role).inc(predicted)
        self.actual_tokens.labels(role).inc(actual)
        self.prediction_error.labels(role).observe(abs(actual - predicted))


class _IndexCollector(Collector):
    def __init__(self, index: KVIndex):
        self._index = index

    def collect(self):
        blocks = GaugeMetricFamily("pdserve_proxy_kv_index_blocks",
                                   "Blocks in the KV index, by role (a block counts once per worker holding it)",
                                   labels=["role"])
        for role, count in sorted(self._index.num_blocks_by_role().items()):
            blocks.add_metric([role], float(count))
        keys = GaugeMetricFamily("pdserve_proxy_kv_index_keys", "Distinct (block hash, group) keys in the KV index")
        keys.add_metric([], float(self._index.num_keys))
        skipped = CounterMetricFamily("pdserve_proxy_kv_index_keys_not_indexed",
                                      "Blocks a worker stored past the index's per-worker bound (not indexed)")
        skipped.add_metric([], float(self._index.num_keys_not_indexed))
        return [blocks, keys, skipped]
