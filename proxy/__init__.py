"""The routing proxy: the only endpoint clients see; it forwards each request in two legs (prefill, then decode).

Imports neither torch, nixl nor `pdserve`: it ships as a slim image. Entry
points: `proxy.app.create_app(ProxyConfig)` and `pdserve proxy` (`proxy.cli`).
"""
