"""SLO judging and a relayed stream's timing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import ProxyMetrics
from proxy.relay import StreamTiming
from proxy.routing.disaggregation import Slo
from proxy.slo import MET, TPOT_MISSED, TTFT_MISSED, SloTracker, client_key, judge

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
    tracker = SloTracker(SLO, metrics.slo_requests, metrics.slo_attainment, window=4, max_client_share=1.0)
    assert tracker.attainment == 1.0
    for ttft_s in (0.1, 0.1, 5.0, 0.1, 0.1, 0.1):
        tracker.observe(10, ttft_s, 0.01)
    assert tracker.attainment == pytest.approx(0.75)  # the last four: met, missed, met, met... and one more met
    assert registry.get_sample_value("pdserve_proxy_slo_requests_total", {"result": "ttft_missed"}) == 1
    assert registry.get_sample_value("pdserve_proxy_slo_attainment_ratio") == pytest.approx(0.75)


def test_one_client_cannot_swing_the_window_alone():
    """Issue 36, item 9: a client that misses on purpose (or floods met requests) holds at most its
    share of the window; its newest requests replace its own oldest, never other clients'."""
    metrics = ProxyMetrics(CollectorRegistry())
    tracker = SloTracker(SLO, metrics.slo_requests, metrics.slo_attainment, window=10, max_client_share=0.2)
    for index in range(8):
        tracker.observe(10, 0.1, 0.01, client_key=f"user-{index}")  # eight clients, all met
    for _ in range(50):
        tracker.observe(10, 9.0, 0.01, client_key="flooder")  # fifty misses from one client
    assert tracker.attainment == pytest.approx(0.8)  # its two entries of ten, not all ten
    for _ in range(50):
        tracker.observe(10, 0.1, 0.01, client_key="flooder")  # now met: still two entries, its own replaced
    assert tracker.attainment == pytest.approx(1.0)


def test_the_client_key_is_the_api_key_else_the_address_and_never_the_key_itself():
    assert client_key("Bearer sk-1", "10.0.0.1") == client_key("Bearer sk-1", "10.0.0.2")
    assert client_key("Bearer sk-1", "10.0.0.1") != client_key("Bearer sk-2", "10.0.0.1")
    assert "sk-1" not in client_key("Bearer sk-1", "10.0.0.1")
    assert client_key(None, "10.0.0.1") != client_key(None, "10.0.0.2")
    assert client_key(None, None) == client_key(None, None)


def test_stream_timing_counts_answer_events_not_the_done_marker():
    timing = StreamTiming()
    timing.saw(b'data: {"a": 1}\n\n', 1.0)
    assert timing.mean_gap_s is None  # one event: no gap yet
    timing.saw(b'data: {"a": 2}\n\ndata: {"a": 3}\n\n', 1.1)
    timing.saw(b"data: [DONE]\n\n", 5.0)
    assert timing.num_events == 3 and timing.last_s == 1.1
    assert timing.mean_gap_s == pytest.approx(0.05)
