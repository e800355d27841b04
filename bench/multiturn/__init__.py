"""The routing benchmark's parts: multi-turn workload, conversation client, worker cluster, report."""
