"""The KV-pull benchmark (`python -m bench.transfer.kv_pull --mode layout|tp|block-size`): one
prompt's KV pulled over NIXL between two processes, timed against an in-process memcpy of the same
bytes over 4 KiB or huge pages (`--memory`); layout also plots bytes and time against the prompt
(`--plot`, or `--plot-from` a report). Invariant: within a mode every case moves the same bytes
between the same two processes; only their description to NIXL differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Optional, Sequence

MODES = ("layout", "tp", "block-size")
DEFAULTS = {  # mode -> (shape, JSON report); prompt sizes and pairs default to the mode's module's
    "layout": ("smollm2", "bench/results/kv_transfer.json"),
    "tp": ("llama3-8b", "bench/results/kv_transfer_tp.json"),
    "block-size": ("smollm2", "bench/results/kv_transfer_block_size.json"),
}


def parse_args(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="layout")
    parser.add_argument("--out", default=None, help="JSON report (default: bench/results/<mode's name>.json)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--memory", choices=["4k-pages", "huge-pages", "both"], default="both",
                        help="back pools and memcpy buffers with 4 KiB pages, huge pages, or run both")
    parser.add_argument("--device", default="cpu", help="layout: cpu, or cuda / cuda:N (GPU memory)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="prompt sizes to pull")
    parser.add_argument("--shape", default=None,
                        help="pool geometry: smollm2 (fp32), llama3-8b (32 layers, 8x128, bf16), tiny (tp, block-size)")
    parser.add_argument("--pairs", nargs="+", default=None,
                        help="tp: prefill:decode TP sizes; block-size: prefill:decode block sizes")
    parser.add_argument("--memcpy-threads", type=int, default=1,
                        help="torch threads for the memcpy baseline and staged copies (UCX copies on one core)")
    parser.add_argument("--plot", default=None, help="layout: draw bytes and time against prompt length here")
    parser.add_argument("--plot-from", default=None, help="draw --plot from this report instead of measuring")
    args = parser.parse_args(argv)
    args.shape = args.shape or DEFAULTS[args.mode][0]
    args.out = args.out or DEFAULTS[args.mode][1]
    return args, parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, parser = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.plot_from:
        from bench.lib.plots import plot_kv_pull

        with open(args.plot_from, encoding="utf-8") as f:
            print(plot_kv_pull(json.load(f), args.plot or args.plot_from.replace(".json", ".png")))
        return 0
    import torch

    from bench.transfer import block_size, layout, tp
    from bench.transfer.pools import write_report

    torch.set_num_threads(args.memcpy_threads)
    module = {"layout": layout, "tp": tp, "block-size": block_size}[args.mode]
    shapes = {"layout": layout.SHAPES, "tp": tp.TP_SHAPES, "block-size": block_size.BS_SHAPES}
    if args.shape not in shapes[args.mode]:
        parser.error(f"--mode {args.mode} takes --shape {' or '.join(sorted(shapes[args.mode]))}")
    if args.device != "cpu" and args.mode != "layout":
        parser.error("only --mode layout runs on a GPU")
    args.prompt_tokens = args.prompt_tokens or list(module.PROMPT_TOKENS)
    if args.mode != "layout":
        try:
            args.pairs = [module.parse_pair(text) for text in args.pairs] if args.pairs else list(module.PAIRS)
        except ValueError as error:
            parser.error(str(error))
    started_s = time.perf_counter()
    shape, fields = module.run(args, parser)
    write_report(args, argv, started_s, shape, **fields)
    if args.plot and args.mode == "layout":
        from bench.lib.plots import plot_kv_pull

        with open(args.out, encoding="utf-8") as f:
            print(plot_kv_pull(json.load(f), args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
