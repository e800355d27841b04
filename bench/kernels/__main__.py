"""Kernel micro-benchmarks, one command and one mode per question:

    python -m bench.kernels moe [--experts 32 --top-k 4]
    python -m bench.kernels decode [--batches 1 16] [--threads 1 --clock cpu]
    python -m bench.kernels decode-ab --baseline REV [decode's flags]
    python -m bench.kernels q4-1 [--rows 1 8 16] [--threads 1 --clock cpu]
    python -m bench.kernels state [--layers 16 --hidden 512] [--block-sizes 16 64]
    python -m bench.kernels tp-rank [--size 2 --batches 1 4]
    python -m bench.kernels all-reduce [--rows 1 --hidden 576]

Every mode prints one markdown table and writes the figures behind it as JSON (`--out`, default
bench/results/kernels_<mode>.json). The modes that compared a native kernel with the code it
replaced (attention, products, fused-layer, step) were retired once they had decided; see
bench/README.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from bench.kernels import all_reduce, decode, decode_ab, moe, q4_1, state, tp_rank
from bench.lib.report import write_document

MODES = {  # mode -> (module adding its flags, function measuring: args -> (table, JSON record))
    "moe": (moe, moe.run),
    "decode": (decode, decode.run),
    "decode-ab": (decode_ab, decode_ab.run),
    "q4-1": (q4_1, q4_1.run),
    "state": (state, state.run),
    "tp-rank": (tp_rank, tp_rank.run),
    "all-reduce": (all_reduce, all_reduce.run),
}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    for name, (module, _) in MODES.items():
        mode = modes.add_parser(name, help=module.__doc__.splitlines()[0])
        mode.add_argument("--out", default=f"bench/results/kernels_{name.replace('-', '_')}.json")
        module.add_arguments(mode, name)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    table, record = MODES[args.mode][1](args)
    print(table)
    write_document(args.out, {"args": vars(args), **record}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
