"""`pdserve up` without models: core planning, the command lines, and supervising real child processes."""

from __future__ import annotations

import argparse

import io
import sys
import time

import pytest

from pdserve.app.cli import build_parser
from pdserve.app.local_cluster import (
    ChildSpec, CorePlan, LocalCluster, PrefixedOutput, build_specs, hands_cores_over, plan_cores,
)
from proxy.cli import proxy_config


def test_two_cores_give_each_worker_its_own():
    assert plan_cores([0, 1]) == CorePlan((0,), (1,), 1, 1)


def test_odd_core_goes_to_decode():
    assert plan_cores([4, 5, 6, 7, 8]) == CorePlan((4, 5), (6, 7, 8), 2, 3)


def test_one_core_pins_nothing():
    assert plan_cores([3]) == CorePlan(None, None, 1, 1)


def specs_for(*argv: str, cores=(0, 1, 2, 3)) -> dict[str, ChildSpec]:
    args = build_parser().parse_args(["up", *argv])
    return {spec.name: spec for spec in build_specs(args, list(cores))}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_specs_start_prefill_decode_then_proxy_wired_together():
    specs = specs_for("--port", "9000", "--prefill-port", "9100", "--decode-port", "9200", "--policy", "prefix")
    assert list(specs) == ["prefill", "decode", "proxy"]
    assert specs["prefill"].argv[:5] == [sys.executable, "-P", "-m", "pdserve.app.cli", "prefill"]  # -P: issue 36
    assert flag(specs["prefill"].argv, "--port") == "9100"
    proxy = specs["proxy"].argv
    assert flag(proxy, "--prefill") == "http://127.0.0.1:9100" and flag(proxy, "--decode") == "http://127.0.0.1:9200"
    assert flag(proxy, "--policy") == "prefix"
    tokens = {spec.env["PDSERVE_INTERNAL_TOKEN"] for spec in specs.values()}
    assert len(tokens) == 1 and len(tokens.pop()) == 32  # one random token shared by all three
    assert all("--internal-token" not in spec.argv for spec in specs.values())  # argv is world-readable


def test_workers_get_thread_counts_and_cores_from_the_plan():
    specs = specs_for(cores=(0, 1, 2, 3))
    assert (specs["prefill"].cores, flag(specs["prefill"].argv, "--num-threads")) == ((0, 1), "2")
    assert (specs["decode"].cores, flag(specs["decode"].argv, "--num-threads")) == ((2, 3), "2")
    assert specs["proxy"].cores is None
    unpinned = specs_for("--no-pin", "--num-threads", "3")
    assert unpinned["decode"].cores is None and flag(unpinned["decode"].argv, "--num-threads") == "3"


def test_core_handover_unpins_the_workers_and_gives_both_the_ledger():
    args = build_parser().parse_args(["up", "--core-handover"])
    specs = {spec.name: spec for spec in build_specs(args, [0, 1, 2, 3], "/tmp/ledger")}
    for name in ("prefill", "decode"):
        argv = specs[name].argv
        assert specs[name].cores is None and flag(argv, "--core-ledger") == "/tmp/ledger"
        assert (flag(argv, "--num-threads"), flag(argv, "--num-threads-alone")) == ("2", "4")
    assert "--core-ledger" not in specs["proxy"].argv


def test_port_zero_picks_distinct_free_ports():
    specs = specs_for("--port", "0", "--prefill-port", "0", "--decode-port", "0")
    ports = {spec.port for spec in specs.values()}
    assert len(ports) == 3 and 0 not in ports


def test_a_free_port_is_never_one_already_handed_out(monkeypatch):
    """Two draws of one `up` once gave two workers the same port: a drawn port already taken is
    drawn again, and so is port 0's answer."""
    from pdserve.app import children

    low, _ = children.ephemeral_port_range()
    first = max(1024, low - children._PORTS_BELOW_EPHEMERAL)
    if low - first < 1000:
        pytest.skip("no room below this host's ephemeral range")
    draws = iter([first + 7, first + 7, first + 11])

    class Scripted:
        def randrange(self, start, stop):
            return next(draws)

    monkeypatch.setattr(children.random, "SystemRandom", Scripted)
    assert children.free_port(taken={first + 7}) == first + 11
    monkeypatch.setattr(children, "ephemeral_port_range", lambda: (1500, 60999))  # no room: port 0's answers
    zero = children.free_port()
    assert children.free_port(taken={zero}) != zero


def test_free_ports_are_drawn_below_the_ephemeral_range_where_outgoing_connections_take_theirs():
    import socket

    from pdserve.app.children import ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(20)]
    if low - 1024 >= 1000:  # room below it (Linux's default: 32768-60999)
        assert all(1024 <= port < low for port in ports), ports
    for port in ports[:3]:  # free indeed: a listener can take it
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_each_worker_gets_an_internal_port_of_its_own_and_up_owns_the_flag():
    given = specs_for("--prefill-port", "9100", "--decode-port", "9200")
    assert [flag(given[name].argv, "--internal-port") for name in ("prefill", "decode")] == ["9101", "9201"]
    with pytest.raises(SystemExit):  # one port cannot serve both workers: `up` does not forward one
        build_parser().parse_args(["up", "--internal-port", "7777"])
    free = specs_for("--port", "0", "--prefill-port", "0", "--decode-port", "0")
    ports = [spec.port for spec in free.values()] + [int(flag(free[name].argv, "--internal-port"))
                                                     for name in ("prefill", "decode")]
    assert len(set(ports)) == 5 and 0 not in ports
    assert "--internal-port" not in free["proxy"].argv


def test_model_flags_are_passed_to_both_workers_only():
    specs = specs_for("--model", "/m.gguf", "--kv-memory", "256MiB", "--max-model-len", "512")
    for name in ("prefill", "decode"):
        assert flag(specs[name].argv, "--model") == "/m.gguf" and flag(specs[name].argv, "--kv-memory") == "256MiB"
    assert "--model" not in specs["proxy"].argv


def test_request_bounds_reach_the_workers_and_the_proxy_alike():
    specs = specs_for("--max-json-depth", "8", "--no-prefix-caching", "--max-body-bytes", "1MiB")
    for name in ("prefill", "decode", "proxy"):
        argv = specs[name].argv
        assert flag(argv, "--max-json-depth") == "8" and flag(argv, "--max-body-bytes") == "1MiB"
    assert "--no-prefix-caching" not in specs["proxy"].argv
    args = build_parser().parse_args(specs["proxy"].argv[4:])
    assert proxy_config(args).limits.max_json_depth == 8


def child(name: str, code: str, cores=None) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", code], port=0, cores=cores)


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_children_logs_are_prefixed_pinned_and_stopped_cleanly():
    out = io.StringIO()
    pinned = "import os, time; print(sorted(os.sched_getaffinity(0))); time.sleep(60)"
    cluster = LocalCluster([child("prefill", pinned, cores=(0,)), child("proxy", "import time; time.sleep(60)")],
                           PrefixedOutput(out))
    cluster.start()
    try:
        assert wait_for(lambda: "[prefill] [0]" in out.getvalue())
        assert cluster.exited() is None
    finally:
        started = time.monotonic()
        cluster.stop(timeout_s=10)
    assert time.monotonic() - started < 5  # SIGTERM, not the kill timeout
    assert all(process.poll() is not None for process in cluster.processes.values())


def test_a_dead_child_is_reported():
    out = io.StringIO()
    cluster = LocalCluster([child("decode", "import sys; print('boom'); sys.exit(3)"),
                            child("proxy", "import time; time.sleep(60)")], PrefixedOutput(out))
    cluster.start()
    try:
        assert wait_for(lambda: cluster.exited() is not None)
        assert cluster.exited() == ("decode", 3)
    finally:
        cluster.stop(timeout_s=10)
    assert "[decode] boom" in out.getvalue()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_their_parent(tmp_path):
    import os
    import signal
    import subprocess

    pid_file = tmp_path / "pid"
    script = (
        "import io, sys, time\n"
        "from pdserve.app.local_cluster import ChildSpec, LocalCluster, PrefixedOutput\n"
        f"spec = ChildSpec('proxy', [sys.executable, '-c', 'import time; time.sleep(60)'], 0)\n"
        "cluster = LocalCluster([spec], PrefixedOutput(io.StringIO()))\n"
        "cluster.start()\n"
        f"open({str(pid_file)!r}, 'w').write(str(cluster.processes['proxy'].pid))\n"
        "time.sleep(60)\n"
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=repo_root)
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        child_pid = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def gone() -> bool:
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                return True
            return False

        assert wait_for(gone)
    finally:
        parent.kill()


def test_supervisor_exits_non_zero_when_a_child_dies_and_zero_on_request():
    import threading

    from pdserve.app.local_cluster import supervise

    out = io.StringIO()
    dying = LocalCluster([child("decode", "import sys; sys.exit(2)"), child("proxy", "import time; time.sleep(60)")],
                         PrefixedOutput(out))
    dying.start()
    try:
        assert supervise(dying, "127.0.0.1", threading.Event()) == 1
    finally:
        dying.stop(timeout_s=10)
    assert "[up] decode exited with status 2; stopping the others" in out.getvalue()

    calm = LocalCluster([child("proxy", "import time; time.sleep(60)")], PrefixedOutput(io.StringIO()))
    calm.start()
    stop = threading.Event()
    stop.set()
    try:
        assert supervise(calm, "127.0.0.1", stop) == 0
    finally:
        calm.stop(timeout_s=10)


def test_health_poll_access_lines_are_kept_off_the_console():
    out = io.StringIO()
    output = PrefixedOutput(out)
    output.write_line("decode", 'INFO:     127.0.0.1:4242 - "GET /load HTTP/1.1" 200 OK')
    output.write_line("decode", 'INFO:     127.0.0.1:4242 - "POST /v1/completions HTTP/1.1" 200 OK')
    assert out.getvalue() == '[decode] INFO:     127.0.0.1:4242 - "POST /v1/completions HTTP/1.1" 200 OK\n'


def test_each_worker_gets_its_own_device_and_workers_sharing_a_gpu_split_its_share():
    split = specs_for("--prefill-device", "cuda:0", "--decode-device", "cuda:1")
    assert flag(split["prefill"].argv, "--device") == "cuda:0" and flag(split["decode"].argv, "--device") == "cuda:1"
    assert "--gpu-memory-utilization" not in split["prefill"].argv  # a GPU each: the worker's own default
    assert "--device" not in split["proxy"].argv
    given = specs_for("--prefill-device", "cuda:0", "--decode-device", "cuda:1", "--gpu-memory-utilization", "0.7")
    assert flag(given["decode"].argv, "--gpu-memory-utilization") == "0.7"
    shared = specs_for("--device", "cuda", "--decode-device", "cuda:0", "--gpu-memory-utilization", "0.8")
    for name in ("prefill", "decode"):
        assert shared[name].argv.count("--gpu-memory-utilization") == 1
        assert flag(shared[name].argv, "--gpu-memory-utilization") == "0.4"
    one_overridden = specs_for("--device", "cuda:1", "--prefill-device", "cuda:0")
    assert [flag(one_overridden[n].argv, "--device") for n in ("prefill", "decode")] == ["cuda:0", "cuda:1"]
    assert one_overridden["prefill"].argv.count("--device") == 1
    for spec in specs_for().values():  # the default: auto for both, one device, the default share split
        if spec.name != "proxy":
            assert "--device" not in spec.argv and flag(spec.argv, "--gpu-memory-utilization") == "0.45"
    with pytest.raises(SystemExit):
        specs_for("--decode-device", "gpu1")


def test_the_disaggregation_policy_and_slo_reach_the_proxy_only():
    specs = specs_for("--disaggregation", "adaptive", "--slo-ttft-ms", "800", "--slo-tpot-ms", "25")
    proxy = specs["proxy"].argv
    assert flag(proxy, "--disaggregation") == "adaptive"
    config = proxy_config(build_parser().parse_args(proxy[4:]))
    assert config.routing.disaggregation == "adaptive"
    assert (config.slo.ttft_ms, config.slo.ttft_ms_per_token, config.slo.tpot_ms) == (800.0, 2.0, 25.0)
    for role in ("prefill", "decode"):
        assert not any(arg.startswith(("--slo", "--disaggregation")) for arg in specs[role].argv)
        assert flag(specs[role].argv, "--max-step-ms") == "25"  # the TPOT objective bounds the workers' steps


def test_up_defaults_to_adaptive_disaggregation_steps_within_the_tpot_and_handed_over_cores():
    args = build_parser().parse_args(["up"])
    assert hands_cores_over(args, [0, 1]) and not hands_cores_over(args, [0])
    specs = {spec.name: spec for spec in build_specs(args, [0, 1])}
    assert flag(specs["proxy"].argv, "--disaggregation") == "adaptive"
    assert flag(specs["decode"].argv, "--max-step-ms") == "20"
    for opt_out in (["--no-core-handover"], ["--no-pin"]):
        assert not hands_cores_over(build_parser().parse_args(["up", *opt_out]), [0, 1])
    given = {spec.name: spec for spec in build_specs(build_parser().parse_args(
        ["up", "--disaggregation", "static", "--max-step-ms", "50"]), [0, 1])}
    assert flag(given["proxy"].argv, "--disaggregation") == "static"
    assert given["decode"].argv.count("--max-step-ms") == 1 and flag(given["decode"].argv, "--max-step-ms") == "50"


def test_up_sends_both_legs_at_once_unless_told_not_to():
    assert "--no-concurrent-legs" not in specs_for()["proxy"].argv
    assert "--no-concurrent-legs" in specs_for("--no-concurrent-legs")["proxy"].argv


def test_up_streams_p_first_token_early_unless_told_not_to():
    assert "--no-early-first-token" not in specs_for()["proxy"].argv
    argv = specs_for("--no-early-first-token")["proxy"].argv
    assert "--no-early-first-token" in argv
    from proxy.cli import add_proxy_arguments, proxy_config
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    assert not proxy_config(parser.parse_args(argv[argv.index("proxy") + 1:])).early_first_token
    assert proxy_config(parser.parse_args(specs_for()["proxy"].argv[argv.index("proxy") + 1:])).early_first_token


@pytest.mark.parametrize("spelling", [["--kv-offload-dir", "/data/tier"], ["--kv-offload-dir=/data/tier"]])
def test_a_file_tier_directory_is_split_between_the_two_workers(spelling):
    """A file tier locks its directory: the two workers each get their own under the one given."""
    specs = specs_for(*spelling)
    assert flag(specs["prefill"].argv, "--kv-offload-dir") == "/data/tier/prefill"
    assert flag(specs["decode"].argv, "--kv-offload-dir") == "/data/tier/decode"
    assert "--kv-offload-dir" not in specs["proxy"].argv
    assert not any(arg.startswith("--kv-offload-dir=") for spec in specs.values() for arg in spec.argv)
