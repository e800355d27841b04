"""The handoff record: components from one process's clock readings, P's wire form, the log fields."""

from __future__ import annotations

import math

import pytest

from pdserve.api.handoff import (COMPONENTS, DECODE_COMPONENTS, PREFILL_COMPONENTS, PROXY_COMPONENTS,
                                 PROXY_LOG_COMPONENTS, ProxyHandoff, elapsed_s, log_fields, parse_prefill_parts,
                                 prefill_parts)
from pdserve.api.kv_transfer import RemotePrefillParams


def test_prefill_parts_split_p_time_at_scheduling_first_token_and_pin():
    assert prefill_parts(10.0, 10.25, 11.0, 11.125) == {"p_queue": 0.25, "p_compute": 0.75, "p_pin": 0.125}


def test_prefill_parts_leave_out_what_p_never_read():
    assert prefill_parts(10.0, None, None, 11.0) == {}
    assert prefill_parts(10.0, 10.5, None, 11.0) == {"p_queue": 0.5}


def test_a_clock_reading_out_of_order_gives_zero_never_a_negative_duration():
    assert elapsed_s(5.0, 4.0) == 0.0
    assert elapsed_s(None, 4.0) is None


def test_wire_parts_keep_known_finite_durations_and_drop_the_rest():
    raw = {"p_queue": 0.5, "p_compute": 2, "p_pin": -1.0, "d_pull": 1.0, "bogus": 3.0}
    assert parse_prefill_parts(raw) == {"p_queue": 0.5, "p_compute": 2.0}
    assert parse_prefill_parts({"p_queue": math.inf, "p_compute": True, "p_pin": 1e9}) == {}
    assert parse_prefill_parts("p_queue=1") == {} and parse_prefill_parts(None) == {}


def test_params_carry_p_parts_and_a_malformed_field_is_dropped_not_refused():
    base = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1]],
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_epoch": "e", "num_prompt_tokens": 3, "lease_s": 30.0}
    params = RemotePrefillParams.model_validate({**base, "handoff_s": {"p_queue": 0.25, "x": 1}})
    assert params.handoff_s == {"p_queue": 0.25}
    assert params.to_wire()["handoff_s"] == {"p_queue": 0.25}
    assert RemotePrefillParams.model_validate({**base, "handoff_s": [1, 2]}).handoff_s == {}
    assert RemotePrefillParams.model_validate(base).handoff_s is None


def _pd_record() -> ProxyHandoff:
    record = ProxyHandoff(arrival_s=100.0)
    record.prefill_sent_s = 100.001
    record.prefill_answered(0.5, 100.501, {"p_queue": 0.1, "p_compute": 0.3, "p_pin": 0.05})
    record.decode_sent_s = 100.503
    record.decode_first_byte_s = 100.553
    record.client_first_byte_s = 100.554
    return record


def test_proxy_record_splits_a_pd_request_into_every_component_in_order():
    parts = _pd_record().parts()
    assert list(parts) == list(PROXY_LOG_COMPONENTS)
    expected = {"proxy_hop": 0.003, "p_queue": 0.1, "p_compute": 0.3, "p_pin": 0.05, "prefill_overhead": 0.05,
                "decode_first_byte": 0.05, "client_first_byte": 0.001}
    assert parts == pytest.approx(expected)


def test_proxy_hop_of_a_retried_prefill_counts_from_the_last_answer_only():
    record = _pd_record()
    record.prefill_answered(0.2, 100.9, {"p_queue": 0.0, "p_compute": 0.15, "p_pin": 0.0})
    record.decode_sent_s = 100.902
    assert record.parts()["proxy_hop"] == pytest.approx(0.003)
    assert record.parts()["prefill_overhead"] == pytest.approx(0.05)


def test_an_older_prefill_worker_without_parts_leaves_them_and_the_overhead_out():
    record = _pd_record()
    record.prefill_answered(0.5, 100.501, {})
    parts = record.parts()
    assert not set(PREFILL_COMPONENTS) & set(parts) and "prefill_overhead" not in parts
    assert parts["decode_first_byte"] == pytest.approx(0.05)


def test_decode_only_request_has_the_hop_to_its_one_leg():
    record = ProxyHandoff(arrival_s=5.0)
    record.decode_sent_s = 5.002
    record.decode_first_byte_s = 5.5
    assert record.parts() == pytest.approx({"proxy_hop": 0.002, "decode_first_byte": 0.498})


def test_log_fields_are_milliseconds_in_component_order():
    assert log_fields({"p_pin": 0.0005, "proxy_hop": 0.25}) == "proxy_hop_ms=250.000 p_pin_ms=0.500"
    assert sorted(COMPONENTS) == sorted(set(PREFILL_COMPONENTS + DECODE_COMPONENTS + PROXY_COMPONENTS))
