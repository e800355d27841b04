"""Micro-benchmark of the native block matmuls at decode sizes: one SmolLM2 layer's four Q4_1
products (1 and 4 rows) and the Q8_0 output head (1 row), checked against the dequantized
weights first. Run it on two checkouts to compare kernels (the library is cached per source):

    python3 bench/block_kernels.py
"""
import os, sys, time, statistics, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdserve.kernels.native import cpu_kernels_available, ops
from pdserve.models.quant.blocks import quantize_q4_1, dequantize
assert cpu_kernels_available()
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [quantize_q4_1(torch.randn(n, k)) for n, k in shapes]
for rows in (1, 4):
    xs = [torch.randn(rows, k) for _, k in shapes]
    for w, x in zip(ws, xs):  # correctness vs dequantized
        ref = x @ dequantize(w, torch.float32).t()
        got = ops().q4_1_linear(x, w.blocks)
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-4, err
    def once():
        for _ in range(30):
            for w, x in zip(ws, xs):
                ops().q4_1_linear(x, w.blocks)
    once()
    ts = []
    for _ in range(7):
        b = time.perf_counter(); once(); ts.append((time.perf_counter() - b) / 30 * 1000)
    print(f"rows={rows}: one layer's 4 q4_1 matmuls {statistics.median(ts):.3f} ms (x30 layers = {30*statistics.median(ts):.1f} ms)")
from pdserve.models.quant.blocks import quantize_q8_0
w8 = quantize_q8_0(torch.randn(49152, 576))
x = torch.randn(1, 576)
ref = x @ dequantize(w8, torch.float32).t()
got = ops().q8_0_linear(x, w8.blocks)
assert (got - ref).abs().max().item() / ref.abs().max().item() < 1e-4
for _ in range(3): ops().q8_0_linear(x, w8.blocks)
ts = []
for _ in range(15):
    b = time.perf_counter(); ops().q8_0_linear(x, w8.blocks); ts.append((time.perf_counter() - b) * 1000)
print(f"q8_0 lm_head 49152x576 at 1 row: {statistics.median(ts):.3f} ms")
