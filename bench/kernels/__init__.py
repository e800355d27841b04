"""Micro-benchmarks of single kernels and the decode step: `python -m bench.kernels.<name>`."""
