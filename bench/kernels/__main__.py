"""Kernel micro-benchmarks, one command and one mode per question:

    python -m bench.kernels attention [--keys 200 400 1000 2000] [--device cuda --rows 16]
    python -m bench.kernels products      # Q4_1 / Q8_0 block products; float32 rows, BLAS against native
    python -m bench.kernels fused-layer [--dtype float32] [--concurrency 16]
    python -m bench.kernels step [--variant NAME] [--concurrency N]
    python -m bench.kernels moe [--experts 32 --top-k 4]
    python -m bench.kernels state [--layers 16 --hidden 512] [--block-sizes 16 64]

Every mode prints one markdown table and writes the figures behind it as JSON (`--out`, default
bench/results/kernels_<mode>.json). Variants of one mode run in one process, rounds interleaved,
so that outside load hits them alike; the native library is cached per source, so comparing a
kernel with the one it replaced means running the mode on two checkouts one after the other.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from bench.kernels import attention, moe, products, state, step
from bench.lib.report import write_document

MODES = {  # mode -> (module adding its flags, function measuring: args -> (table, JSON record))
    "attention": (attention, attention.run),
    "products": (products, products.run),
    "fused-layer": (step, step.run_fused),
    "step": (step, step.run_variants),
    "moe": (moe, moe.run),
    "state": (state, state.run),
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
