"""The KV offload tier: TTFT with and without it, store and load costs (`python -m bench.kv_offload`)."""
