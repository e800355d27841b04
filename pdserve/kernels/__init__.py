"""Native CPU kernels, compiled on the serving machine at first use and cached per machine.

`native` builds, loads and describes them (`torch.ops.pdserve_cpu`). The C++ sources hold one
operation each: `quantized_matmul.cpp`, `decode_attention.cpp`, `fused_layer.cpp` (with
`fused_layer.h`), `greedy.cpp`, and `registration.cpp` (the op schemas); `common.h` and
`kernels.h` are what they share. Imports nothing of pdserve.
"""
