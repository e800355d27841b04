"""Which worker serves a request: pairing policies, and kv_aware routing's KV index and event client.

Read in this order: `policies` (round robin, least loaded, prefix hash),
`kv_prompt` and `token_cache` (a prompt's block hashes, as the workers compute
them), `kv_index` (which worker holds which block, from their KV events),
`kv_events_client` (following each worker's event stream), `policies_kv` (the
score of a candidate), `kv_metrics`, and `kv_routing` (the kv_aware policy
assembled). Imports the rest of the proxy only for `backends` and `config`.
"""
