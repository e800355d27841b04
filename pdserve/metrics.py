"""Prometheus metrics of one worker, built by a factory on a private registry.

No globals: every `Metrics` owns its `CollectorRegistry`, so two workers (or
two tests) in one process never share or clash on a series. Labels stay of low
cardinality (a finish reason, a status code, a KV group index), never an id;
request ids ride on latency observations as exemplars (OpenMetrics only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.api.handoff import HANDOFF_BUCKETS_S
from pdserve.gie_metrics import model_server_protocol_families

# Bucket edges chosen for LLM serving: a first token takes milliseconds (prefix
# hit, tiny prompt) to tens of seconds (long prompt behind a queue); a decode
# step is milliseconds; a whole request can last minutes.
TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)
E2E_BUCKETS_S = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)
QUEUE_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
_OPENMETRICS_ALLOW_UTF8 = getattr(openmetrics, "ALLOWUTF8", None)
_EXEMPLAR_MAX_RUNES = 128  # OpenMetrics' limit on an exemplar's label names and values together
_EXEMPLAR_LABEL = "request_id"


def request_exemplar(request_id: Optional[str]) -> Optional[dict[str, str]]:
    """The request id as an exemplar, cut to what OpenMetrics allows."""
    if not request_id:
        return None
    return {_EXEMPLAR_LABEL: request_id[: _EXEMPLAR_MAX_RUNES - len(_EXEMPLAR_LABEL)]}


STEP_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)


class RequestMetrics:
    """Per-request latency and token counts, recorded by the HTTP layer."""

    def __init__(self, registry: CollectorRegistry):
        self.time_to_first_token_s = Histogram(
            "pdserve_request_time_to_first_token_seconds",
            "Time from the HTTP request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS_S, registry=registry,
        )
        self.inter_token_latency_s = Histogram(
            "pdserve_request_inter_token_latency_seconds",
            "Time between two consecutive engine outputs of one request, per output.",
            buckets=INTER_TOKEN_BUCKETS_S, registry=registry,
        )
        self.e2e_latency_s = Histogram(
            "pdserve_request_e2e_latency_seconds",
            "Time from the HTTP request's arrival to its last token.",
            buckets=E2E_BUCKETS_S, registry=registry,
        )
        self.prompt_tokens = Counter(
            "pdserve_request_prompt_tokens_total", "Prompt tokens of handled requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "pdserve_request_generation_tokens_total", "Tokens generated for requests.", registry=registry
        )
        self.finished = Counter(
            "pdserve_request_finished_total",
            "Requests that ended, by reason (stop, length, abort, error).",
            ["reason"], registry=registry,
        )
        self.errors = Counter(
            "pdserve_request_errors_total",
            "Requests answered with an error, by HTTP status.",
            ["status"], registry=registry,
        )

    def observe_first_token(self, latency_s: float, request_id: Optional[str] = None) -> None:
        self.time_to_first_token_s.observe(latency_s, exemplar=request_exemplar(request_id))

    def observe_inter_token(self, latency_s: float) -> None:
        self.inter_token_latency_s.observe(latency_s)

    def observe_finished(
        self, reason: str, e2e_latency_s: float, num_prompt_tokens: int, num_generation_tokens: int,
        request_id: Optional[str] = None,
    ) -> None:
        self.finished.labels(reason=reason).inc()
        self.e2e_latency_s.observe(e2e_latency_s, exemplar=request_exemplar(request_id))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)

    def count_error(self, status_code: int) -> None:
        self.errors.labels(status=str(status_code)).inc()


class SchedulerMetrics:
    """Queue times and preemptions, recorded by the engine loop (queue sizes: `LoadMetrics`)."""

    def __init__(self, registry: CollectorRegistry):
        self.queue_time_s = Histogram(
            "pdserve_scheduler_queue_time_seconds",
            "Time a request waited between arrival and its first scheduling.",
            buckets=QUEUE_BUCKETS_S, registry=registry,
        )
        self.preemptions = Counter(
            "pdserve_scheduler_preemptions_total", "Requests preempted for lack of KV blocks.", registry=registry
        )

    def observe_queue_time(self, queue_time_s: float) -> None:
        self.queue_time_s.observe(queue_time_s)

    def count_preemptions(self, num_preemptions: int = 1) -> None:
        self.preemptions.inc(num_preemptions)


class KVCacheMetrics:
    """Prefix-cache effectiveness (the pool's usage: `LoadMetrics`)."""

    def __init__(self, registry: CollectorRegistry):
        self.prefix_cache_queries_tokens = Counter(
            "pdserve_kv_prefix_cache_queries_tokens_total",
            "Prompt tokens looked up in the prefix cache.", registry=registry,
        )
        self.prefix_cache_hits_tokens = Counter(
            "pdserve_kv_prefix_cache_hits_tokens_total",
            "Prompt tokens found in the prefix cache.", registry=registry,
        )

        self.prefix_cache_hits_by_medium_tokens = Counter(
            "pdserve_kv_prefix_cache_hits_by_medium_tokens_total",
            "Prompt tokens found in the prefix cache, by where: device (the pool), offload (from the first "
            "block loaded from the offload tier on), peer (pulled from another worker's pool).", ["medium"],
            registry=registry,
        )
        self.peer_pull_tokens = Counter(
            "pdserve_kv_peer_pull_tokens_total",
            "Prompt tokens a peer hint named, by result: pulled (read from the peer, not computed), failed (peer "
            "dead, pin or READ failed, lease ran out: computed), refused (incompatible peer or chain: computed), "
            "miss (the peer held less than worth pulling: computed), skipped (under --peer-pull-min-tokens), costlier "
            "(this worker's measurements predicted the pull no faster than computing).",
            ["result"], registry=registry,
        )
        self.peer_pull_s = Histogram(
            "pdserve_kv_peer_pull_duration_seconds",
            "Time of a peer pull that landed, from the pin's answer to the last block read.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=registry,
        )
        self.peer_pinned_tokens = Counter(
            "pdserve_kv_peer_pinned_tokens_total",
            "Prompt tokens this worker pinned for peers to pull (holder side), by where they were: device (the "
            "pool), offload (loaded from the offload tier into the pool for the peer).", ["medium"], registry=registry,
        )
        self.peer_pull_cost_s_per_token = Gauge(
            "pdserve_kv_peer_pull_token_cost_seconds",
            "The peer-pull decision's measured price of a prompt token here, by path: compute (prefill steps), "
            "pull (landed peer pulls); both start at seeds (pd/peer_costs.py).", ["path"], registry=registry,
        )
        self.peer_pull_pin_s = Gauge(
            "pdserve_kv_peer_pull_pin_seconds",
            "The peer-pull decision's measured fixed price of a pull: a pin's round trip.", registry=registry,
        )

    def watch_peer_pull_costs(self, compute_s_per_token: Callable[[], float], pull_s_per_token: Callable[[], float],
                              pin_s: Callable[[], float]) -> None:
        self.peer_pull_cost_s_per_token.labels("compute").set_function(compute_s_per_token)
        self.peer_pull_cost_s_per_token.labels("pull").set_function(pull_s_per_token)
        self.peer_pull_pin_s.set_function(pin_s)

    def count_peer_pull(self, result: str, num_tokens: int) -> None:
        self.peer_pull_tokens.labels(result=result).inc(num_tokens)
        if result == "pulled":
            self.prefix_cache_hits_by_medium_tokens.labels("peer").inc(num_tokens)

    def count_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int, num_offload_hit_tokens: int = 0) -> None:
        self.prefix_cache_queries_tokens.inc(num_query_tokens)
        self.prefix_cache_hits_tokens.inc(num_hit_tokens)
        self.prefix_cache_hits_by_medium_tokens.labels("device").inc(num_hit_tokens - num_offload_hit_tokens)
        self.prefix_cache_hits_by_medium_tokens.labels("offload").inc(num_offload_hit_tokens)


OFFLOAD_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class OffloadMetrics:
    """The KV offload tier behind the pool (--kv-offload-bytes); zero when there is none."""

    def __init__(self, registry: CollectorRegistry):
        self.bytes = Counter("pdserve_kv_offload_bytes_total", "Bytes copied into (store) and out of (load) the "
                             "offload tier.", ["direction"], registry=registry)
        self.usage_ratio = Gauge("pdserve_kv_offload_usage_ratio", "Share of the offload tier's pages in use.",
                                 registry=registry)
        self.failed_loads = Counter("pdserve_kv_offload_failed_loads_total", "Offload loads that failed (the "
                                    "request recomputed its prefix).", registry=registry)
        self.duration_s = Histogram("pdserve_kv_offload_duration_seconds", "Time of one offload store (one page) "
                                    "or load (one request's pages).", ["direction"], buckets=OFFLOAD_BUCKETS_S,
                                    registry=registry)
        self.skipped_stores = Counter("pdserve_kv_offload_skipped_stores_total", "Evicted pages the offload tier "
                                      "did not keep: busy (every staging row waits for the disk, or every slot is "
                                      "pinned by a load), failed (the write failed, e.g. a full disk).", ["reason"],
                                      registry=registry)
        for direction in ("store", "load"):
            self.bytes.labels(direction)
        for reason in ("busy", "failed"):
            self.skipped_stores.labels(reason)

    def record_tier_activity(self, num_store_bytes: int, num_load_bytes: int, num_failed_loads: int,
                store_seconds: list[float], load_seconds: list[float], usage_ratio: float,
                num_busy_stores: int = 0, num_failed_stores: int = 0) -> None:
        self.bytes.labels("store").inc(num_store_bytes)
        self.bytes.labels("load").inc(num_load_bytes)
        self.failed_loads.inc(num_failed_loads)
        self.skipped_stores.labels("busy").inc(num_busy_stores)
        self.skipped_stores.labels("failed").inc(num_failed_stores)
        for seconds in store_seconds:
            self.duration_s.labels("store").observe(seconds)
        for seconds in load_seconds:
            self.duration_s.labels("load").observe(seconds)
        self.usage_ratio.set(usage_ratio)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The engine's queues and KV pool as one turn of its loop left them."""

    num_running: int = 0
    num_waiting: int = 0  # queued, plus waiting for their remote KV to land
    num_blocks_in_use_by_group: tuple[int, ...] = ()
    num_pool_blocks: int = 0  # blocks that can hold KV (the null block excluded); 0 until the engine is built
    block_size: int = 0

    def usage_by_group(self) -> tuple[float, ...]:
        pool = self.num_pool_blocks or 1
        return tuple(num_in_use / pool for num_in_use in self.num_blocks_in_use_by_group)

    @property
    def usage(self) -> float:
        """The whole pool's: every in-use block belongs to exactly one group."""
        return sum(self.num_blocks_in_use_by_group) / (self.num_pool_blocks or 1)


class LoadMetrics:
    """Queue sizes and KV-pool usage: pdserve's gauges and the GIE model-server protocol's
    (`pdserve/gie_metrics.py`), all built from one snapshot in one collect, so that no scrape
    shows the two spellings disagreeing. The engine thread swaps the snapshot whole."""

    def __init__(self, registry: CollectorRegistry):
        self._load = LoadSnapshot()
        self._started_s = time.time()
        registry.register(self)

    def update(self, load: LoadSnapshot) -> None:
        self._load = load  # one reference store: a concurrent collect reads the old record or the new one

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        load = self._load
        running = GaugeMetricFamily("pdserve_scheduler_running_requests", "Requests currently scheduled.")
        running.add_metric([], load.num_running)
        waiting = GaugeMetricFamily("pdserve_scheduler_waiting_requests", "Requests waiting (including for remote KV).")
        waiting.add_metric([], load.num_waiting)
        usage = GaugeMetricFamily("pdserve_kv_usage_ratio", "Fraction of the shared block pool held by a KV group "
                                  "(0..1).", labels=["group"])
        for group_id, ratio in enumerate(load.usage_by_group()):
            usage.add_metric([str(group_id)], ratio)
        pool = GaugeMetricFamily("pdserve_kv_pool_blocks", "Blocks of the KV pool that can hold KV, all groups "
                                 "together (0 until the model is loaded).")
        pool.add_metric([], load.num_pool_blocks)
        yield from (running, waiting, usage, pool)
        yield from model_server_protocol_families(load.num_waiting, load.num_running, load.usage, load.block_size,
                                                  load.num_pool_blocks, self._started_s)


class EngineMetrics:
    """Cost of the engine loop itself."""

    def __init__(self, registry: CollectorRegistry):
        self.step_duration_s = Histogram(
            "pdserve_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward, update).",
            buckets=STEP_BUCKETS_S, registry=registry,
        )
        self.computed_prompt_tokens = Counter(
            "pdserve_engine_computed_prompt_tokens_total",
            "Prompt tokens the model actually computed (prefix-cache hits and pulled KV excluded).",
            registry=registry,
        )
        self.progress_age_s = Gauge(
            "pdserve_engine_progress_age_seconds",
            "Seconds since the engine loop last completed an iteration (grows while a step runs or the loop is stuck).",
            registry=registry,
        )
        self.tensor_parallel_size = Gauge(
            "pdserve_engine_tensor_parallel_ranks",
            "Tensor-parallel ranks this worker's model is split over (1: not split).",
            registry=registry,
        )
        self.tensor_parallel_ranks = Gauge(
            "pdserve_engine_tensor_parallel_serving_ranks",
            "Ranks serving together right now: the TP size while the engine runs, 0 once a rank is lost.",
            registry=registry,
        )
        self.tensor_parallel_size.set(1)
        self.cpu_threads = Gauge(
            "pdserve_engine_cpu_threads",
            "Torch CPU threads the engine's steps run with (with --core-ledger it follows the other worker's work).",
            registry=registry,
        )

    def watch_ranks(self, size: int, serving: Callable[[], bool]) -> None:
        """Export the TP size, and the ranks serving (all of them while `serving()`, else none)."""
        self.tensor_parallel_size.set(size)
        self.tensor_parallel_ranks.set_function(lambda: size if serving() else 0)

    def observe_step(self, duration_s: float) -> None:
        self.step_duration_s.observe(duration_s)

    def watch_progress(self, progress_age_s: Callable[[], float]) -> None:
        """Export the engine loop's last-progress age (a stuck loop shows as a growing value)."""
        self.progress_age_s.set_function(progress_age_s)

    def count_computed_prompt_tokens(self, num_tokens: int) -> None:
        self.computed_prompt_tokens.inc(num_tokens)


TRANSFER_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
THROUGHPUT_BUCKETS_BYTES_PER_S = tuple(float(1 << shift) for shift in range(20, 38, 1))  # 1 MiB/s .. 128 GiB/s


class TransferMetrics:
    """KV movement between prefill and decode workers (both sides record here)."""

    def __init__(self, registry: CollectorRegistry):
        self.bytes = Counter("pdserve_transfer_bytes_total", "KV bytes pulled from prefill workers.", registry=registry)
        self.descriptors = Counter(
            "pdserve_transfer_descriptors_total", "NIXL descriptors (one per block page) read.", registry=registry
        )
        self.duration_s = Histogram(
            "pdserve_transfer_duration_seconds", "Time from starting a KV pull to its completion.",
            buckets=TRANSFER_BUCKETS_S, registry=registry,
        )
        self.throughput = Histogram(
            "pdserve_transfer_throughput_bytes_per_second", "Bytes per second of each completed KV pull.",
            buckets=THROUGHPUT_BUCKETS_BYTES_PER_S, registry=registry,
        )
        self.failures = Counter(
            "pdserve_transfer_failures_total", "KV pulls that failed, by what was done about it.",
            ["policy"], registry=registry,
        )
        self.agent_restarts = Counter(
            "pdserve_transfer_agent_restarts_total", "Times this worker's NIXL agent process died and was "
            "replaced (--kv-agent-isolation process): its reads in flight failed, peers reconnect.", registry=registry)
        self.notification_failures = Counter(
            "pdserve_transfer_notification_failures_total", "Messages to a prefill worker that could not be sent.",
            registry=registry,
        )
        self.rejected_messages = Counter(
            "pdserve_transfer_rejected_messages_total",
            "P: done/free/renew messages ignored, by reason (malformed; stale: no live pin of that id carries "
            "its nonce, a late message about an earlier pin or a stranger's)", ["reason"], registry=registry)
        self.expired_leases = Counter(
            "pdserve_transfer_expired_leases_total",
            "Pinned KV (a prefill for a decode worker, or a prefix lent to a peer) freed because its lease ran out.",
            registry=registry,
        )
        self.handshakes = Counter(
            "pdserve_transfer_handshakes_total", "Agent-info handshakes with prefill workers.", registry=registry
        )
        self.pinned_blocks = Gauge(
            "pdserve_transfer_pinned_blocks",
            "Blocks this worker holds for remote readers (P: its prefills for decode workers and prefixes for peers; "
            "D: prefixes for peers).", registry=registry
        )
        self.pinned_blocks_limit = Gauge(
            "pdserve_transfer_pinned_limit_blocks",
            "Most blocks this worker may hold for remote readers (--kv-max-pinned-share of its pool).",
            registry=registry,
        )
        self.pinned_refusals = Counter(
            "pdserve_transfer_pinned_refusals_total",
            "Remote-decode prefills refused (503) because pinned blocks reached their limit.", registry=registry,
        )
        self.recomputed_prompt_tokens = Counter(
            "pdserve_pd_recomputed_prompt_tokens_total",
            "D: prompt tokens of requests that came as P/D but were prefilled here, by reason (pull_failed: P "
            "unreachable or the READ failed; prompt_mismatch: P's pin holds another prompt; stale_ticket: P holds "
            "no claimable pin, or its lease ran short before the pull). D's own prefix cache may spare some.",
            ["reason"], registry=registry)
        self.first_token_from_prefill = Counter(
            "pdserve_pd_first_token_from_prefill_total",
            "D: P/D requests that started from the first token P sampled (its ticket's): D pulled every prompt "
            "token's KV and computed no prompt token.", registry=registry)
        self.first_token_recomputed = Counter(
            "pdserve_pd_first_token_recomputed_total",
            "D: P/D requests whose KV P handed over but whose first token D computed again, by reason "
            "(structured_output, recurrent_state, logprobs_mismatch, no_first_token, sampling_mismatch: "
            "pd/first_token.py).",
            ["reason"], registry=registry)
        self.first_token_kept_recomputing = Counter(
            "pdserve_pd_first_token_kept_recomputing_total",
            "D: P/D requests whose prompt D computed after all (pdserve_pd_recomputed_prompt_tokens_total's reasons) "
            "that still went on from P's first token: output token 1 is P's, D's prefill draws token 2.",
            registry=registry)
        self.handoff_s = Histogram(
            "pdserve_pd_handoff_seconds",
            "P/D handoff components measured here, per request (docs/metrics.md): on P p_queue (arrival to first "
            "scheduling), p_compute (to its first token sampled), p_pin (to the pin issued); on D d_ticket (arrival "
            "to P's ticket claimed), d_admit (P's source verified to the READ started: D's engine queue and "
            "admission), d_pull (KV READ start to landed), d_first_step (P's token sent as output token 1 "
            "to D's first sampled token sent).",
            ["component"], buckets=HANDOFF_BUCKETS_S, registry=registry)
        self.waiting_for_kv = Gauge(
            "pdserve_transfer_waiting_for_kv_requests", "Decode requests whose KV pull is in flight.",
            registry=registry,
        )

    def observe_handoff(self, parts: dict[str, float]) -> None:
        """Handoff components of one request, by name (fixed names: pdserve/api/handoff.py)."""
        for component, seconds in parts.items():
            self.handoff_s.labels(component=component).observe(seconds)

    def observe_pull(self, num_bytes: int, num_descriptors: int, duration_s: float) -> None:
        self.bytes.inc(num_bytes)
        self.descriptors.inc(num_descriptors)
        self.duration_s.observe(duration_s)
        self.handoff_s.labels(component="d_pull").observe(duration_s)
        if duration_s > 0:
            self.throughput.observe(num_bytes / duration_s)


class Metrics:
    """All metrics of one worker process, one sub-object per subsystem.

    A new subsystem (e.g. KV transfer) is a class taking the registry in its
    constructor plus one attribute here; nothing else changes.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.request = RequestMetrics(self.registry)
        self.scheduler = SchedulerMetrics(self.registry)
        self.kv = KVCacheMetrics(self.registry)
        self.offload = OffloadMetrics(self.registry)
        self.engine = EngineMetrics(self.registry)
        self.transfer = TransferMetrics(self.registry)
        self.load = LoadMetrics(self.registry)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)

    def render_openmetrics(self) -> bytes:
        """The registry in OpenMetrics format, which carries the request-id exemplars.

        Every name here is a legacy Prometheus name, so allowing UTF-8 changes nothing but one
        thing: prometheus_client's default escaping turns the ':' of the GIE protocol's sample
        names into '_' (leaving their HELP and TYPE lines alone), which would split those gauges."""
        if _OPENMETRICS_ALLOW_UTF8 is None:  # a prometheus_client from before UTF-8 names never escapes
            return openmetrics.generate_latest(self.registry)
        return openmetrics.generate_latest(self.registry, escaping=_OPENMETRICS_ALLOW_UTF8)


def create_metrics() -> Metrics:
    return Metrics(CollectorRegistry())
