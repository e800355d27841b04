"""A worker's HTTP layer: the OpenAI API, P/D KV routes, health and metrics.

Read in this order: `app` (`create_app`, a factory: no module-level app),
`context` (what the routes share), `errors` (typed errors -> HTTP status,
OpenAI bodies), `openai_routes` -> `preprocess` (tokens and sampling, checked)
-> `choices` (one engine request per choice) -> `generation` and `streaming`
(one request's trip, SSE) -> `formatting` and `chat_formatting` (OpenAI
bodies); then `tokenize_routes`, `kv_routes` (P/D's release and agent info),
`kv_events` and `kv_events_routes` (the KV event stream), `ops_routes`
(`/health`, `/ready`, `/live`, `/load`, `/metrics`).

May import: api, kv, request, pd, engine, models, grammar, tools, metrics. Never imports app.
"""
