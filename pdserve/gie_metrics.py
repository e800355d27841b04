"""The gauges the Gateway API Inference Extension's model-server protocol names, so that an endpoint
picker (GIE's EPP, llm-d's inference scheduler) scrapes a pdserve worker as it scrapes vLLM.

Invariant: these are a second spelling of pdserve's own queue and KV-pool gauges, never a second
count: `pdserve.metrics.LoadMetrics` builds both families from one snapshot in one collect.
The names are the protocol's, not ours (hence no `pdserve_` prefix): GIE release v1.5.0,
docs/proposals/003-model-server-protocol, and the names its EPP maps for the "vllm" engine
(pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go), which llm-d's
inference scheduler v0.8.0 uses unchanged.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
PROTOCOL_NAMES = (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE, CACHE_CONFIG_INFO, LORA_REQUESTS_INFO)


def model_server_protocol_families(
    num_waiting: int, num_running: int, usage: float, block_size: int, num_pool_blocks: int, lora_updated_s: float,
) -> list[Metric]:
    """The protocol's five gauges for one snapshot of the engine.

    `usage` is the whole pool's (blocks in use over usable blocks, every KV group together) as a
    fraction from 0 to 1, whatever the `_perc` in the name says: the EPP's KV scorer reads it so.
    `vllm:cache_config_info` names the pool once it exists (`num_gpu_blocks` is the pool's size
    on whatever device holds it). The LoRA gauge carries one series with no adapters: the EPP skips
    a series whose adapter lists are both empty, and finds the family it looks for."""
    waiting = GaugeMetricFamily(NUM_REQUESTS_WAITING, "Requests queued, including those waiting for "
                                "remote KV (the protocol's TotalQueuedRequests; pdserve_scheduler_waiting_requests).")
    waiting.add_metric([], num_waiting)
    running = GaugeMetricFamily(NUM_REQUESTS_RUNNING, "Requests being computed (the protocol's "
                                "TotalRunningRequests; pdserve_scheduler_running_requests).")
    running.add_metric([], num_running)
    kv_usage = GaugeMetricFamily(KV_CACHE_USAGE, "Share of the KV pool's blocks in use, all KV groups together, "
                                 "as a fraction from 0 to 1 (the protocol's KVCacheUtilization).")
    kv_usage.add_metric([], usage)
    cache_config = GaugeMetricFamily(CACHE_CONFIG_INFO, "The KV pool's shape in labels: tokens per block and "
                                     "usable blocks (value 1).", labels=["block_size", "num_gpu_blocks"])
    if num_pool_blocks:
        cache_config.add_metric([str(block_size), str(num_pool_blocks)], 1)
    lora = GaugeMetricFamily(LORA_REQUESTS_INFO, "LoRA adapters loaded and waiting (pdserve serves none); the "
                             "value is when this was last set, in Unix seconds.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    lora.add_metric(["0", "", ""], lora_updated_s)
    return [waiting, running, kv_usage, cache_config, lora]
