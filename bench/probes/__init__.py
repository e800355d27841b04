"""One-off probes that decided something (bench/README.md says what): `python -m bench.probes.<name>`."""
