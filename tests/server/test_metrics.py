"""Metrics: private registries, naming conventions, and the recording methods the engine will call."""

from __future__ import annotations

import re

from pdserve.gie_metrics import PROTOCOL_NAMES
from pdserve.metrics import LoadSnapshot, Metrics, create_metrics

NAME_PATTERN = re.compile(r"^pdserve_(request|scheduler|kv|engine|transfer|pd)_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_seconds", "_ratio", "_requests", "_total", "_blocks", "_bytes_per_second", "_ranks", "_threads")
# Names a protocol owns, not we: the gauges GIE's model-server protocol names, which an endpoint
# picker reads by these exact names (docs/operations.md, "Running under llm-d / GIE"). Listed one by
# one, so the house rule still holds for every name of our own.
FOREIGN_PROTOCOL_NAMES = {
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info", "vllm:lora_requests_info",
}


def declared_types(metrics: Metrics) -> dict[str, str]:
    """Exposed name -> type, from the `# TYPE` lines, minus prometheus_client's own `*_created` gauges."""
    types = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):
                types[name] = kind
    return types


def test_two_metrics_objects_do_not_share_series():
    first, second = create_metrics(), create_metrics()
    first.request.count_error(400)
    assert first.registry.get_sample_value("pdserve_request_errors_total", {"status": "400"}) == 1.0
    assert second.registry.get_sample_value("pdserve_request_errors_total", {"status": "400"}) is None


def test_metric_names_follow_the_house_convention():
    types = declared_types(create_metrics())
    assert len(types) >= 16
    assert set(PROTOCOL_NAMES) == FOREIGN_PROTOCOL_NAMES
    for name in FOREIGN_PROTOCOL_NAMES:
        assert types.pop(name) == "gauge", name  # the protocol asks for gauges
    for name, kind in types.items():
        assert NAME_PATTERN.match(name), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert name.endswith(UNIT_SUFFIXES) and not name.endswith("_total"), name


def test_engine_side_recorders_update_their_series():
    metrics = create_metrics()
    metrics.scheduler.observe_queue_time(0.2)
    metrics.load.update(LoadSnapshot(num_running=3, num_waiting=7, num_blocks_in_use_by_group=(10, 20),
                                     num_pool_blocks=40, block_size=16))
    metrics.scheduler.count_preemptions(2)
    metrics.kv.count_prefix_lookup(num_query_tokens=64, num_hit_tokens=48)
    metrics.engine.observe_step(0.012)
    metrics.engine.count_computed_prompt_tokens(16)
    value = metrics.registry.get_sample_value
    assert value("pdserve_scheduler_queue_time_seconds_count") == 1.0
    assert value("pdserve_scheduler_running_requests") == 3.0
    assert value("pdserve_scheduler_waiting_requests") == 7.0
    assert value("pdserve_scheduler_preemptions_total") == 2.0
    assert value("pdserve_kv_usage_ratio", {"group": "0"}) == 0.25
    assert value("pdserve_kv_usage_ratio", {"group": "1"}) == 0.5
    assert value("pdserve_kv_pool_blocks") == 40.0
    assert value("pdserve_kv_prefix_cache_queries_tokens_total") == 64.0
    assert value("pdserve_kv_prefix_cache_hits_tokens_total") == 48.0
    assert value("pdserve_engine_step_duration_seconds_count") == 1.0
    assert value("pdserve_engine_computed_prompt_tokens_total") == 16.0


def test_request_recorders_count_tokens_and_reasons():
    metrics = create_metrics()
    metrics.request.observe_first_token(0.05)
    metrics.request.observe_inter_token(0.01)
    metrics.request.observe_finished("length", e2e_latency_s=1.5, num_prompt_tokens=10, num_generation_tokens=4)
    value = metrics.registry.get_sample_value
    assert value("pdserve_request_time_to_first_token_seconds_count") == 1.0
    assert value("pdserve_request_inter_token_latency_seconds_count") == 1.0
    assert value("pdserve_request_e2e_latency_seconds_sum") == 1.5
    assert value("pdserve_request_finished_total", {"reason": "length"}) == 1.0
    assert value("pdserve_request_prompt_tokens_total") == 10.0
    assert value("pdserve_request_generation_tokens_total") == 4.0



def test_gie_protocol_gauges_spell_the_same_snapshot_as_ours():
    metrics = create_metrics()
    metrics.load.update(LoadSnapshot(num_running=2, num_waiting=5, num_blocks_in_use_by_group=(3, 6),
                                     num_pool_blocks=12, block_size=32))
    value = metrics.registry.get_sample_value
    assert value("vllm:num_requests_running") == value("pdserve_scheduler_running_requests") == 2.0
    assert value("vllm:num_requests_waiting") == value("pdserve_scheduler_waiting_requests") == 5.0
    # The whole pool's share in use, a fraction (not a percentage, whatever the name says).
    assert value("vllm:kv_cache_usage_perc") == 9 / 12
    assert value("vllm:kv_cache_usage_perc") == sum(
        value("pdserve_kv_usage_ratio", {"group": group}) for group in ("0", "1"))
    assert value("vllm:cache_config_info", {"block_size": "32", "num_gpu_blocks": "12"}) == 1.0
    lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert value("vllm:lora_requests_info", lora) > 0  # when it was set: no adapters, ever


def test_gie_cache_info_waits_for_the_pool_and_the_rest_start_at_zero():
    metrics = create_metrics()
    text = metrics.render().decode()
    assert "vllm:num_requests_waiting 0.0" in text and "vllm:kv_cache_usage_perc 0.0" in text
    assert "# TYPE vllm:cache_config_info gauge" in text
    assert "vllm:cache_config_info{" not in text, "no pool yet, so no shape to name"


def test_both_expositions_keep_the_protocol_names_as_written():
    """prometheus_client's default OpenMetrics escaping would turn the ':' into '_' in sample lines only."""
    metrics = create_metrics()
    metrics.load.update(LoadSnapshot(num_running=1, num_pool_blocks=8, block_size=16, num_blocks_in_use_by_group=(2,)))
    for text in (metrics.render().decode(), metrics.render_openmetrics().decode()):
        samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
        assert FOREIGN_PROTOCOL_NAMES <= samples
        assert not {name.replace(":", "_") for name in FOREIGN_PROTOCOL_NAMES} & samples
