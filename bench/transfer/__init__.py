"""KV transfer benchmarks: `python -m bench.transfer.kv_pull --mode ...` and `python -m bench.transfer.agent_isolation`."""
