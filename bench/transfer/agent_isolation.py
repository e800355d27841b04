"""What running the NIXL agent in its own process costs (`--kv-agent-isolation process` against
`inline`): KV pull time and the per-call overhead of the engine thread's agent calls, side by side.

    python -m bench.transfer.agent_isolation [--prompt-tokens 512 2048] [--reps 7] [--ucx-tls tcp]
                                        [--out bench/results/kv_agent_isolation.json]

Two prefill/decode pairs run at once, one per mode, each a spawned prefill child serving a
patterned pool and this process reading it; reps alternate between the modes so both see the
same machine. Inline pools are private huge-page memory; isolated pools are shared memfd memory
that the agent processes map (transparent huge pages there only where
/sys/kernel/mm/transparent_hugepage/shmem_enabled allows). Every read is checked byte for byte.
Results are ratios (process / inline), not absolute times: machines here are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time


import torch

from bench.transfer.pools import prefill_child, time_read

from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.transport import PeerInfo

# The embedded SmolLM2's pages: 30 layers x K/V x 16 tokens x 3 KV heads x 64 dims x fp32 = 737,280 bytes.
SHAPE = dict(group_size=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
SHAPE_PAGE_BYTES = SHAPE["group_size"] * 2 * SHAPE["block_size"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 4
MODES = ("inline", "process")
POLL_CALLS = 2000


def pattern(view: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(view.shape[0], dtype=torch.int64).unsqueeze(1) * 1009
    return (torch.arange(view.shape[1], dtype=torch.int64) * 7 + rows).remainder(251).to(torch.int8)


def pool(num_blocks: int, mode: str) -> torch.Tensor:
    layout = KVPoolLayout(num_blocks=num_blocks, **SHAPE)
    return layout.canonical_view(layout.allocate("cpu", shared=mode == "process"))


def serve_prefill(mode: str, num_blocks: int, out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    view = pool(num_blocks, mode)
    view.copy_(pattern(view))
    transport = NixlTransport(view, f"bench-iso-prefill-{mode}", isolated=mode == "process")
    out.put(json.dumps(transport.local_peer_info(f"prefill-{mode}", "0").to_dict()))
    while not stop.is_set():
        transport.poll_notifications()
        time.sleep(0.0005)
    transport.close()


def timed_read(transport: NixlTransport, key: str, num_blocks: int) -> float:
    ids = list(range(1, num_blocks + 1))
    return time_read(transport, key, ids, ids)


def poll_overhead_us(transport: NixlTransport) -> float:
    started = time.perf_counter()
    for _ in range(POLL_CALLS):
        transport.poll_notifications()
    return (time.perf_counter() - started) / POLL_CALLS * 1e6


def run(prompt_tokens: list[int], reps: int) -> dict:
    num_blocks = max(prompt_tokens) // SHAPE["block_size"] + 2
    pairs = {}
    with contextlib.ExitStack() as children:
        for mode in MODES:
            published, _ = children.enter_context(prefill_child(serve_prefill, mode, num_blocks, timeout_s=120))
            peer = PeerInfo.from_dict(published)
            view = pool(num_blocks, mode)
            transport = NixlTransport(view, f"bench-iso-decode-{mode}", isolated=mode == "process")
            pairs[mode] = (transport, view, transport.connect(peer))
        expected = pattern(pool(num_blocks, "inline"))
        rows = []
        for tokens in prompt_tokens:
            blocks = -(-tokens // SHAPE["block_size"])
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for rep in range(reps + 1):  # the first of each is a warm-up, not counted
                for mode in MODES:
                    transport, view, key = pairs[mode]
                    view.zero_()
                    elapsed = timed_read(transport, key, blocks)
                    if not torch.equal(view[1:blocks + 1], expected[1:blocks + 1]):
                        raise RuntimeError(f"{mode}: the pulled pages differ from the prefill's")
                    if rep:
                        times[mode].append(elapsed)
            mib = blocks * SHAPE_PAGE_BYTES / 2**20
            medians = {mode: statistics.median(times[mode]) for mode in MODES}
            rows.append({"prompt_tokens": tokens, "blocks": blocks, "mib": round(mib, 1),
                         **{f"{mode}_ms": round(medians[mode] * 1e3, 2) for mode in MODES},
                         **{f"{mode}_gb_per_s": round(mib * 2**20 / medians[mode] / 1e9, 2) for mode in MODES},
                         "time_ratio_process_over_inline": round(medians["process"] / medians["inline"], 3)})
        overhead = {mode: round(poll_overhead_us(pairs[mode][0]), 1) for mode in MODES}
        for transport, _, _ in pairs.values():
            transport.close()
        return {"rows": rows, "poll_notifications_us": overhead, "reps": reps,
                "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"), "shape": {**SHAPE, "dtype": "float32"},
                "page_bytes": SHAPE_PAGE_BYTES, "shmem_thp": _shmem_thp()}



def _shmem_thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def format_table(result: dict) -> str:
    lines = ["| prompt tokens | MiB | inline ms | process ms | inline GB/s | process GB/s | process / inline |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['prompt_tokens']} | {row['mib']} | {row['inline_ms']} | {row['process_ms']} "
                     f"| {row['inline_gb_per_s']} | {row['process_gb_per_s']} "
                     f"| {row['time_ratio_process_over_inline']:.2f} |")
    overhead = result["poll_notifications_us"]
    lines.append(f"\npoll_notifications per call: inline {overhead['inline']} us, process {overhead['process']} us "
                 f"(UCX_TLS={result['ucx_tls']}, shmem THP: {result['shmem_thp']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--ucx-tls", default=None, help="set UCX_TLS for every agent (e.g. tcp, as between pods)")
    parser.add_argument("--out", default="bench/results/kv_agent_isolation.json")
    args = parser.parse_args(argv)
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    result = run(args.prompt_tokens, args.reps)
    print(format_table(result))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
