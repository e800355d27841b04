"""Flags generated from the config models: one declaration per setting, used by every command."""

from __future__ import annotations

import pytest

from pdserve.api.config import (DEFAULT_PORTS, CacheConfig, LimitsConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                ServerConfig, TransferConfig)
from pdserve.api.flags import ConfigError, flag_specs, worker_config
from pdserve.app.cli import build_parser, main
from pdserve.app.local_cluster import build_specs


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_every_config_field_has_exactly_one_flag_on_p_and_d():
    fields = {(section, name) for section, model in (("model", ModelConfig), ("cache", CacheConfig),
                                                     ("scheduler", SchedulerConfig), ("server", ServerConfig),
                                                     ("transfer", TransferConfig), ("limits", LimitsConfig),
                                                     ("parallel", ParallelConfig))
              for name in model.model_fields}
    specs = flag_specs("decode")
    assert {(spec.section, spec.name) for spec in specs} == fields
    assert len({spec.flag for spec in specs}) == len(specs)
    assert all(spec.help for spec in specs)


@pytest.mark.parametrize("command, role", [("serve", "colocated"), ("prefill", "prefill"), ("decode", "decode")])
def test_defaults_come_from_the_config_with_the_role_port(command, role):
    config = worker_config(parse(command), role)
    assert config.server.port == DEFAULT_PORTS[role]
    assert config.cache == CacheConfig() and config.scheduler == SchedulerConfig() and config.transfer == TransferConfig()


def test_flags_map_onto_their_fields_with_their_parsers():
    config = worker_config(parse("decode", "--kv-memory", "256MiB", "--no-prefix-caching", "--kv-lease-s", "40",
                                 "--kv-pull-timeout-s", "20", "--served-model-name", "m", "--max-num-running", "3"),
                           "decode")
    assert config.cache.kv_memory_bytes == 256 << 20 and not config.cache.enable_prefix_caching
    assert (config.transfer.lease_s, config.transfer.pull_timeout_s) == (40, 20)
    assert config.model.served_name == "m" and config.scheduler.max_num_running == 3


@pytest.mark.parametrize("command, role, keeps", [("serve", "colocated", True), ("decode", "decode", True),
                                                 ("prefill", "prefill", False)])
def test_one_row_tiles_are_kept_where_batch_1_steps_run_unless_turned_off(command, role, keeps):
    assert worker_config(parse(command), role).keeps_one_row_tiles is keeps
    assert worker_config(parse(command, "--no-one-row-tiles"), role).keeps_one_row_tiles is False


def test_the_internal_token_falls_back_to_its_environment_variable(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "from-env")
    assert worker_config(parse("prefill"), "prefill").server.internal_token == "from-env"
    assert worker_config(parse("prefill", "--internal-token", "flag"), "prefill").server.internal_token == "flag"


def test_a_decode_pull_timeout_longer_than_half_the_lease_is_refused_with_the_flags_named(capsys):
    with pytest.raises(ConfigError, match="--kv-pull-timeout-s.*--kv-lease-s"):
        worker_config(parse("decode", "--kv-pull-timeout-s", "20"), "decode")
    assert main(["decode", "--kv-pull-timeout-s", "20"]) == 2
    assert "must be at most half" in capsys.readouterr().err
    worker_config(parse("prefill", "--kv-lease-s", "4"), "prefill")  # only a decode worker pulls


def test_out_of_range_values_name_their_flag():
    with pytest.raises(ConfigError, match="--max-num-running"):
        worker_config(parse("serve", "--max-num-running", "0"), "colocated")


def test_up_forwards_exactly_the_worker_flags_it_was_given_verbatim():
    args = parse("up", "--kv-memory", "256MiB", "--no-prefix-caching", "--kv-failure-policy", "fail",
                 "--max-num-batched-tokens", "64")
    specs = {spec.name: spec for spec in build_specs(args, [0, 1])}
    for role in ("prefill", "decode"):
        argv = specs[role].argv
        for given in (["--kv-memory", "256MiB"], ["--no-prefix-caching"], ["--kv-failure-policy", "fail"],
                      ["--max-num-batched-tokens", "64"]):
            assert any(argv[i:i + len(given)] == given for i in range(len(argv))), (given, argv)
        assert "--kv-lease-s" not in argv, "a flag not given must not be forwarded (the worker's default applies)"
    assert "--kv-memory" not in specs["proxy"].argv


def test_up_checks_forwarded_values_like_the_worker_would(capsys):
    with pytest.raises(SystemExit):
        parse("up", "--kv-memory", "lots")
    assert "not a size" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_p_and_d_on_a_reachable_address_refuse_to_start_without_a_token(role, monkeypatch):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="needs an internal token"):
        worker_config(parse(role, "--host", "0.0.0.0"), role)
    assert worker_config(parse(role, "--host", "0.0.0.0", "--internal-token", "t"), role).server.internal_token == "t"
    assert worker_config(parse(role, "--host", "0.0.0.0", "--insecure-no-token"), role).server.insecure_no_token
    for loopback in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        worker_config(parse(role, "--host", loopback), role)


def test_a_colocated_worker_needs_no_token_anywhere(monkeypatch):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    assert worker_config(parse("serve", "--host", "0.0.0.0"), "colocated").server.internal_token is None


def test_an_empty_token_is_a_configuration_error(monkeypatch):
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="--internal-token: .*must not be empty"):
        worker_config(parse("prefill", "--internal-token", " "), "prefill")


def test_the_peer_allow_list_takes_hosts_and_cidrs():
    config = worker_config(parse("decode", "--kv-allowed-peers", "p0.svc, 10.0.0.0/24,10.1.2.3"), "decode")
    assert config.transfer.allowed_peers == "p0.svc, 10.0.0.0/24,10.1.2.3"
    with pytest.raises(ConfigError, match="--kv-allowed-peers"):
        worker_config(parse("decode", "--kv-allowed-peers", "p0,,p1"), "decode")


def test_request_bounds_are_flags_of_every_worker():
    config = worker_config(parse("serve", "--max-body-bytes", "1MiB", "--max-json-depth", "8",
                                 "--max-prompt-chars", "100", "--header-timeout-s", "2"), "colocated")
    limits = config.limits
    assert (limits.max_body_bytes, limits.max_json_depth, limits.max_prompt_chars) == (1 << 20, 8, 100)
    assert limits.header_timeout_s == 2


def test_tensor_parallel_flags_parse_with_the_short_alias_and_name_the_bad_combinations():
    config = worker_config(parse("prefill", "-tp", "3"), "prefill")
    assert config.parallel.tensor_parallel_size == 3 and config.parallel.tp_rank is None and config.parallel.is_leader
    follower = worker_config(parse("decode", "--tensor-parallel-size", "2", "--tp-rank", "1", "--tp-master-addr",
                                   "10.0.0.5", "--tp-master-port", "29500"), "decode")
    assert (follower.parallel.tp_rank, follower.parallel.tp_master_addr) == (1, "10.0.0.5")
    assert not follower.parallel.is_leader
    with pytest.raises(ConfigError, match="--tp-rank 2 is not below --tensor-parallel-size 2"):
        worker_config(parse("serve", "-tp", "2", "--tp-rank", "2", "--tp-master-port", "29500"), "colocated")
    with pytest.raises(ConfigError, match="--tp-rank needs --tp-master-port"):
        worker_config(parse("serve", "-tp", "2", "--tp-rank", "1"), "colocated")
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        worker_config(parse("serve", "-tp", "0"), "colocated")


def test_up_gives_each_role_its_own_tensor_parallel_size_and_keeps_the_rank_flags_to_itself():
    specs = build_specs(parse("up", "-tp", "2", "--decode-tensor-parallel-size", "3", "--no-pin"), [0, 1])
    prefill, decode = specs[0].argv, specs[1].argv
    assert prefill[prefill.index("-tp") + 1] == "2"
    assert decode[decode.index("--tensor-parallel-size") + 1] == "3"
    assert decode.index("--tensor-parallel-size") > decode.index("-tp")  # the last one wins
    with pytest.raises(SystemExit):
        parse("up", "--tp-rank", "1")
