"""Tensor parallelism's plumbing: the ranks of one worker meeting and talking over torch.distributed.

`ranks` is the process group (gloo on the CPU; NCCL for tensors and gloo for
control records on CUDA) with a timeout on every collective. What travels
over it (scheduled steps, transport commands) is defined by its users:
`pdserve.runner.tensor_parallel` and `pdserve.transfer.ranked_transport`.
May import: api. Imports torch, never nixl.
"""
