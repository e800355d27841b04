"""The routing proxy: the only endpoint clients see; it forwards each request in two legs (prefill, then decode).

Imports neither torch nor nixl, and of pdserve only `pdserve.api` (the contract)
and `pdserve.kv` (hashing, prefix rule, event format): it ships as a slim image.
Entry points: `proxy.app.create_app(ProxyConfig)` and `pdserve proxy` (`proxy.cli`).

Read in this order: `config`, `cli`, `app`; a request's path: `client_request`
(validated once, with the workers' code) -> `routing/` (which workers) ->
`forwarder` -> `legs` (prefill leg, decode leg) -> `relay` (the decode stream
back to the client); around it: `backends` (pools, load, `breaker`), `health`,
`discovery`, `transport`, `kv_release`, `kv_routes`, `errors`, `metrics`.
"""
