"""A KV pull through isolated NIXL agents, as the engine loop times it (`python -m bench.transfer.agent_read`).

D starts a READ of `--pages` scattered SmolLM2 pages (737,280 bytes each, notifying P as
pdserve/pd/decode.py does), polls it every POLL_WAIT_S as pdserve/engine/loop.py does, and releases
it. Cases, in turns, each first in turn: the read ops of pdserve/transfer/read_steps.py (`stepwise`: a
call per step; `single`: one call to start, the agent releases; `+settle2ms`: the agent progresses
it up to 2 ms first), from a prefill whose agent process progresses itself between calls (P on) or
only when its engine calls (P off). `--busy N` keeps N spinning processes on the cores meanwhile.
Invariant: every case pulls the same pages, each through its own decode agent process, from one of
two identical prefill processes; only the read op and P's self-progress differ.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Optional, Sequence

CASES = {  # name -> (D's read op, D's settle_s, P's agent progressing itself)
    "stepwise, P off": ("stepwise", 0.0, False),  # before issue 38's change
    "single, P off": ("single", 0.0, False),
    "single+settle2ms, P off": ("single", 0.002, False),
    "single, P on": ("single", 0.0, True),
    "single+settle2ms, P on": ("single", 0.002, True),  # the default now
}
LAYOUT = dict(group_size=30, block_size=16, num_kv_heads=3, head_dim=64)  # SmolLM2-135M, fp32: 737,280 B pages
NUM_BLOCKS = 64
WARM_UP_TURNS = 5  # every local page read once (the agent process faults its mapping in)


def pool():
    import torch

    from pdserve.kv.layout import KVPoolLayout

    layout = KVPoolLayout(num_blocks=NUM_BLOCKS, dtype=torch.float32, **LAYOUT)
    return layout.canonical_view(layout.allocate("cpu", shared=True))


def serve_prefill(out, stop, self_progress: bool) -> None:
    """Child: a pool behind an isolated agent, polled every POLL_WAIT_S as an engine loop with a lease
    pending polls it, until told to stop; its agent process progresses itself between calls or not."""
    from pdserve.engine.loop import POLL_WAIT_S
    from pdserve.transfer.nixl_transport import NixlTransport

    view = pool()
    view.fill_(3)
    transport = NixlTransport(view, f"bench-read-prefill-{self_progress}", isolated=True)
    if not self_progress:
        transport._agent.set_self_progress(0.0)
    out.put(json.dumps(transport.local_peer_info("prefill", "e0").to_dict()))
    while not stop.is_set():
        transport.poll_notifications()
        time.sleep(POLL_WAIT_S)
    transport.close()


def spin(stop) -> None:
    """Child: keeps one core busy, as a worker's compute does, until told to stop."""
    while not stop.is_set():
        sum(range(10_000))


def pull_s(transport, key: str, local: list[int], remote: list[int], notification: bytes) -> tuple[float, int]:
    """The pull's time, start to release, and how many engine polls it waited (0: DONE when started)."""
    from pdserve.engine.loop import POLL_WAIT_S
    from pdserve.transfer.transport import TransferState

    started = time.perf_counter()
    handle = transport.start_read(key, local, remote, notification)
    num_polls = 0
    while transport.poll(handle) is TransferState.PENDING:
        time.sleep(POLL_WAIT_S)
        num_polls += 1
    if handle.state is not TransferState.DONE or not transport.release(handle):
        raise RuntimeError(f"the read failed: {handle.error}")
    return time.perf_counter() - started, num_polls


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=15, help="pages per pull (15: a 240-token prompt, 11 MB)")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes on the cores meanwhile")
    parser.add_argument("--no-notification", action="store_true",
                        help="reads notify P of nothing (pdserve/pd/decode.py's pulls notify)")
    parser.add_argument("--out", default="bench/results/agent_read.json")
    args = parser.parse_args(argv)
    from pdserve.transfer.nixl_transport import NixlTransport
    from pdserve.transfer.transport import PeerInfo, wait_connected

    context = multiprocessing.get_context("spawn")
    stop, outs = context.Event(), {on: context.Queue() for on in (False, True)}
    prefills = [context.Process(target=serve_prefill, args=(outs[on], stop, on), daemon=True) for on in outs]
    for prefill in prefills:
        prefill.start()
    spinners = [context.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    transports = {}
    try:
        peers = {on: PeerInfo.from_dict(json.loads(out.get(timeout=120))) for on, out in outs.items()}
        for name, (read_op, settle_s, on) in CASES.items():
            view = pool()
            view.zero_()
            transport = NixlTransport(view, f"bench-read-{name}", isolated=True, read_op=read_op,
                                      read_settle_s=settle_s)
            transports[name] = (transport, wait_connected(transport, peers[on], 30.0))
        for spinner in spinners:
            spinner.start()
        remote = list(range(1, 2 * args.pages, 2))  # scattered: the prepared lists, one descriptor per page
        times, polls = {name: [] for name in CASES}, {name: [] for name in CASES}
        for rep in range(args.reps + WARM_UP_TURNS):
            local = [(rep * 7 + 3 * i) % NUM_BLOCKS for i in range(args.pages)]  # distinct (3 is prime to 64)
            names = list(transports)
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # each case first in turn
                transport, key = transports[name]
                elapsed_s, num_polls = pull_s(transport, key, local, remote, b"" if args.no_notification else b"pulled")
                if rep >= WARM_UP_TURNS:
                    times[name].append(elapsed_s)
                    polls[name].append(num_polls)
    finally:
        for transport, _ in transports.values():
            transport.close()
        stop.set()
        for process in (*prefills, *spinners):
            process.join(timeout=30)
    base = statistics.median(times["stepwise, P off"])
    print(f"{args.pages} pages, {args.reps} turns, busy {args.busy}\n"
          "| read op | p50 ms | p90 ms | p50 / stepwise, P off | DONE when started |")
    for name, values in times.items():
        p50, p90 = statistics.median(values), statistics.quantiles(values, n=10)[-1]
        print(f"| {name} | {p50 * 1e3:.2f} | {p90 * 1e3:.2f} | {p50 / base:.2f} | {polls[name].count(0)} |")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"command": " ".join(["python -m bench.transfer.agent_read", *(argv or sys.argv[1:])]),
                   "pages": args.pages, "busy": args.busy, "times_s": times, "polls": polls}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
