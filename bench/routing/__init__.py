"""Routing: a multi-turn chat workload under each proxy routing policy (`python -m bench.routing`)."""
