"""Proxy configuration: URL normalisation, validation, and the flags that build it."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from proxy.cli import add_proxy_arguments, proxy_config
from proxy.config import DiscoveryConfig, ProxyConfig, normalize_url, split_host_port


def parse(*argv: str) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    return proxy_config(parser.parse_args(list(argv)))


def test_urls_are_normalised_and_deduplicated():
    config = ProxyConfig(prefill_urls=["127.0.0.1:8100", "http://127.0.0.1:8100/"], decode_urls=["https://d:1"])
    assert config.prefill_urls == ("http://127.0.0.1:8100",)
    assert config.decode_urls == ("https://d:1",)


def test_a_decode_backend_is_required():
    with pytest.raises(ValidationError, match="decode backend"):
        ProxyConfig(prefill_urls=["p:1"])
    assert ProxyConfig(discovery=DiscoveryConfig(decode_dns="decode.svc:8200")).decode_urls == ()


def test_without_prefill_backends_the_proxy_has_no_prefill_tier():
    assert not ProxyConfig(decode_urls=["d:1"]).has_prefill
    assert ProxyConfig(decode_urls=["d:1"], discovery=DiscoveryConfig(prefill_dns="p.svc:1")).has_prefill


@pytest.mark.parametrize("bad", ["ftp://x:1", "unix:///tmp/sock"])
def test_non_http_urls_are_rejected(bad):
    with pytest.raises(ValueError):
        normalize_url(bad)


def test_dns_targets_need_a_port():
    assert split_host_port("pd-decode.default.svc.cluster.local:8200") == ("pd-decode.default.svc.cluster.local", 8200)
    with pytest.raises(ValidationError):
        DiscoveryConfig(decode_dns="pd-decode")


def test_flags_accept_several_urls_per_flag_and_repeated_flags():
    config = parse("--prefill", "p:1", "p:2", "--prefill", "p:3", "--decode", "d:1")
    assert config.prefill_urls == ("http://p:1", "http://p:2", "http://p:3")


def test_policy_flag_sets_both_roles_and_role_flags_override():
    config = parse("--decode", "d:1", "--policy", "round_robin", "--prefill-policy", "prefix")
    assert (config.routing.prefill_policy, config.routing.decode_policy) == ("prefix", "round_robin")
    default = parse("--decode", "d:1")
    assert (default.routing.prefill_policy, default.routing.decode_policy) == ("least_loaded", "least_loaded")


def test_failure_and_timeout_flags_reach_the_config():
    config = parse("--decode", "d:1", "--breaker-failures", "5", "--breaker-cooldown-s", "2.5",
                   "--prefill-timeout-s", "30", "--decode-timeout-s", "60", "--disagg-min-prompt-tokens", "64",
                   "--chars-per-token", "3.5", "--internal-token", "tok", "--retry-after-s", "7")
    assert (config.health.breaker_failures, config.health.breaker_cooldown_s) == (5, 2.5)
    assert (config.timeouts.prefill_s, config.timeouts.decode_s) == (30, 60)
    assert (config.routing.disagg_min_prompt_tokens, config.routing.chars_per_token) == (64, 3.5)
    assert (config.internal_token, config.retry_after_s) == ("tok", 7)


def test_out_of_range_flags_are_configuration_errors():
    with pytest.raises(ValidationError):
        parse("--decode", "d:1", "--breaker-failures", "0")


def test_an_empty_internal_token_is_a_configuration_error():
    with pytest.raises(ValidationError, match="must not be empty"):
        parse("--decode", "d:1", "--internal-token", "")
