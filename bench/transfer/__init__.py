"""KV transfer benchmarks: `python -m bench.transfer.kv_pull --mode layout|tp|block-size`."""
