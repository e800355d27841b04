"""The proxy ships without torch and nixl (slim image): it must import and serve where importing them fails,
and of pdserve it may load only `pdserve.api` (the validation it shares with the workers and what that needs)
and `pdserve.kv` (the KV hashing, prefix rule and event format kv_aware routing needs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKER = textwrap.dedent("""
    import sys

    class Blocker:
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ImportError(f"{name} is not installed in this image")
            return None
""")


# Of pdserve, the proxy may load the package itself and modules of these two subpackages only: the
# contract it shares with the workers, and the torch-free KV hashing, prefix rule and event format
# kv_aware routing needs (tests/test_import_rules.py checks the same rule on the source).
PROXY_MAY_LOAD = ("pdserve.api", "pdserve.kv")


def outside_the_rule(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m != "pdserve" and ".".join(m.split(".")[:2]) not in PROXY_MAY_LOAD)


def run_blocked(blocked: tuple[str, ...], body: str) -> subprocess.CompletedProcess:
    code = BLOCKER + f"sys.meta_path.insert(0, Blocker({blocked!r}))\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_proxy_serves_a_request_where_torch_and_nixl_cannot_be_imported():
    result = run_blocked(("torch", "nixl", "llguidance"), """
        import httpx
        from proxy.app import create_app
        from tests.proxy.proxy_stubs import Served, ServedProxy, StubWorker, fast_config

        with Served(StubWorker("prefill", "p0").app()) as p, Served(StubWorker("decode", "d0").app()) as d:
            with ServedProxy(fast_config([p.url], [d.url])) as proxy:
                proxy.wait_ready()
                answer = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}).json()
                streamed = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "stream": True}).text
        print(answer["choices"][0]["text"])
        print(streamed.count("data: "))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nixl")))
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "pdserve")))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[:3] == ["from p0", "4", "[]"]
    imported = set(lines[3].split(","))
    assert outside_the_rule(imported) == [], "the proxy loaded pdserve modules outside api/ and kv/"
    assert "pdserve.api.validation" in imported  # it validates with the workers' own code


def test_pdserve_proxy_command_line_parses_without_torch():
    result = run_blocked(("torch", "nixl"), """
        from pdserve.app.cli import build_parser
        from proxy.cli import proxy_config

        args = build_parser().parse_args(["proxy", "--prefill", "p:1", "p:2", "--decode", "http://d:3/",
                                          "--policy", "prefix", "--decode-policy", "least_loaded"])
        config = proxy_config(args)
        print(config.prefill_urls, config.decode_urls, config.routing.prefill_policy, config.routing.decode_policy)
        build_parser().parse_args(["up", "--port", "0"])
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nixl")))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "('http://p:1', 'http://p:2') ('http://d:3',) prefix least_loaded"
    assert lines[1] == "[]"


def test_the_import_rule_names_what_lies_outside_api_and_kv():
    assert outside_the_rule({"pdserve", "pdserve.api.validation", "pdserve.kv.hashing"}) == []
    assert outside_the_rule({"pdserve.api", "pdserve.request", "pdserve.engine.loop", "pdserve.apix"}) == [
        "pdserve.apix", "pdserve.engine.loop", "pdserve.request"]
