"""Can two processes on this GPU share memory through CUDA IPC? (UCX's cuda_ipc transport needs it.)

    python -m bench.probes.cuda_ipc_probe

A child process receives a CUDA tensor from this one through torch.multiprocessing (which
uses cudaIpcGetMemHandle / cudaIpcOpenMemHandle), adds one to it in place and exits; this
process then reads the result. Prints "cuda ipc: works" or "cuda ipc: fails (<error>)"."""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp


def bump(shared: torch.Tensor, errors) -> None:
    try:
        shared.add_(1)
        torch.cuda.synchronize()
    except Exception as error:  # report, do not hang the parent
        errors.put(repr(error))


def main() -> int:
    context = mp.get_context("spawn")
    errors = context.Queue()
    shared = torch.zeros(1 << 20, device="cuda")
    child = context.Process(target=bump, args=(shared, errors))
    child.start()
    child.join(timeout=60)
    if not errors.empty():
        print(f"cuda ipc: fails ({errors.get()})")
        return 1
    ok = child.exitcode == 0 and bool((shared == 1).all())
    print("cuda ipc: works" if ok else f"cuda ipc: fails (child exit {child.exitcode}, sum {float(shared.sum())})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
