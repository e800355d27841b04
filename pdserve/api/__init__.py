"""The contract: what crosses a process boundary, shared by the workers and the proxy.

Torch-free and nixl-free; imports nothing of pdserve outside this package, so the
proxy can carry it without the engine.
"""
