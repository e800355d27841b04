"""Metrics: private registries, naming conventions, and the recording methods the engine will call."""

from __future__ import annotations

import re

from pdserve.metrics import Metrics, create_metrics

NAME_PATTERN = re.compile(r"^pdserve_(request|scheduler|kv|engine|transfer)_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_seconds", "_ratio", "_requests", "_total", "_blocks", "_bytes_per_second", "_ranks")


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
    for name, kind in types.items():
        assert NAME_PATTERN.match(name), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert name.endswith(UNIT_SUFFIXES) and not name.endswith("_total"), name


def test_engine_side_recorders_update_their_series():
    metrics = create_metrics()
    metrics.scheduler.observe_queue_time(0.2)
    metrics.scheduler.set_queue_sizes(num_running=3, num_waiting=7)
    metrics.scheduler.count_preemptions(2)
    metrics.kv.set_usage(0, 0.25)
    metrics.kv.set_usage(1, 0.5)
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

