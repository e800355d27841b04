"""Single-row float32 products at SmolLM2's decode sizes: BLAS (F.linear) against pdserve's
native kernel, interleaved in one process, after checking that both agree.

    python3 bench/float_row_linear.py
"""
import os, sys, time, statistics, torch
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdserve.kernels.native import cpu_kernels_available, ops
assert cpu_kernels_available()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [torch.randn(n, k) for n, k in shapes]; xs = [torch.randn(1, k) for _, k in shapes]
head = torch.randn(49152, 576); xh = torch.randn(1, 576)
for w, x in zip(ws + [head], xs + [xh]):
    torch.testing.assert_close(ops().f32_row_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
def layer(fn):
    for w, x in zip(ws, xs): fn(x, w)
res = {}
for name, fn in [("F.linear", F.linear), ("f32_row_linear", ops().f32_row_linear)]:
    res[name] = ([], [])
for r in range(7):
    for name, fn in [("F.linear", F.linear), ("f32_row_linear", ops().f32_row_linear)]:
        b = time.perf_counter()
        for _ in range(20): layer(fn)
        res[name][0].append((time.perf_counter() - b) / 20 * 1000)
        b = time.perf_counter()
        for _ in range(10): fn(xh, head)
        res[name][1].append((time.perf_counter() - b) / 10 * 1000)
for name, (a, h) in res.items():
    print(f"{name}: one fp32 layer's 4 products at 1 row {statistics.median(a):.3f} ms; fp32 head {statistics.median(h):.3f} ms")
