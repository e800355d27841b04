"""SLO judging and a relayed stream's timing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import ProxyMetrics
from proxy.relay import StreamTiming
from proxy.routing.disaggregation import Slo
from proxy.slo import MET, TPOT_MISSED, TTFT_MISSED, SloTracker, judge

SLO = Slo(ttft_ms=1000, ttft_ms_per_token=2, tpot_ms=20)


def test_the_ttft_budget_grows_with_the_prompt_and_ttft_is_judged_first():
    assert judge(SLO, 1536, 4.0, 0.019) == MET  # budget 1 s + 3.072 s
    assert judge(SLO, 1536, 4.1, 0.019) == TTFT_MISSED
    assert judge(SLO, 10, 0.5, 0.021) == TPOT_MISSED
    assert judge(SLO, 10, 2.0, 0.5) == TTFT_MISSED
    assert judge(SLO, 10, 0.5, None) == MET  # one token: no TPOT to judge


def test_attainment_is_over_the_last_window_of_judged_requests():
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    tracker = SloTracker(SLO, metrics.slo_requests, metrics.slo_attainment, window=4)
    assert tracker.attainment == 1.0
    for ttft_s in (0.1, 0.1, 5.0, 0.1, 0.1, 0.1):
        tracker.observe(10, ttft_s, 0.01)
    assert tracker.attainment == pytest.approx(0.75)  # the last four: met, missed, met, met... and one more met
    assert registry.get_sample_value("pdserve_proxy_slo_requests_total", {"result": "ttft_missed"}) == 1
    assert registry.get_sample_value("pdserve_proxy_slo_attainment_ratio") == pytest.approx(0.75)


def test_stream_timing_counts_answer_events_not_the_done_marker():
    timing = StreamTiming()
    timing.saw(b'data: {"a": 1}\n\n', 1.0)
    assert timing.mean_gap_s is None  # one event: no gap yet
    timing.saw(b'data: {"a": 2}\n\ndata: {"a": 3}\n\n', 1.1)
    timing.saw(b"data: [DONE]\n\n", 5.0)
    assert timing.num_events == 3 and timing.last_s == 1.1
    assert timing.mean_gap_s == pytest.approx(0.05)
