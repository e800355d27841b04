"""Structured outputs: OpenAI constraints -> llguidance grammars (compiler) -> per-step token masks (matchers).

llguidance was chosen over xgrammar and outlines-core: it installs from PyPI with
no dependencies (xgrammar pulls transformers, triton and an unpinned torch),
needs no ahead-of-time index per schema (outlines-core builds a full automaton
per schema, seconds for nested ones) and computes a 49k-token mask in well
under a millisecond on one CPU core. Everything llguidance-specific lives in
this package; the rest of pdserve sees grammar text (a string) and masks.
"""
