"""Which workers serve a request: `route.choose_route`, a pure function from the request and the
proxy's signals to a `Route`, with the policies, the disaggregation estimate and kv_aware's KV index.

Read in this order: `candidates` (what routing sees: worker snapshots, a request's
routing facts, picks), `policies` (round robin, least loaded, prefix hash),
`disaggregation` (prefill worker or decode worker, against the SLO), `route` (the
choice assembled), then kv_aware: `kv_prompt` and `token_cache` (a prompt's block
hashes, as the workers compute them), `kv_index` (which worker holds which block,
from their KV events), `kv_events_client` (following each worker's event stream),
`policies_kv` (the score of a candidate), `kv_metrics`, and `kv_routing` (kv_aware's
signals for the forwarder). Imports the rest of the proxy only for `backends` and `config`.
"""
