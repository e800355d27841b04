"""Chaos: kills at forced phases under load (`python -m bench.chaos`)."""
