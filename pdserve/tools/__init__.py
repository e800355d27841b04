"""Tool calling: reading the calls a model wrote (forced by a grammar, or in its chat template's native format).

`parsers` is the only module; torch-free. Imports nothing of pdserve.
"""
