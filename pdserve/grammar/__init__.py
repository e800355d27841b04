"""Structured outputs: OpenAI constraints -> llguidance grammars (compiler) -> per-step token masks (matchers).

llguidance was chosen over xgrammar and outlines-core: it installs from PyPI with
no dependencies (xgrammar pulls transformers, triton and an unpinned torch),
needs no ahead-of-time index per schema (outlines-core builds a full automaton
per schema, seconds for nested ones) and computes a 49k-token mask in well
under a millisecond on one CPU core. llguidance lives in two places: this
package (`compiler`: constraint -> validated grammar text at the HTTP edge;
`errors`) and `pdserve.runner.grammar_matchers` (per-request matchers on the
engine thread). The rest of pdserve sees grammar text (a string) and masks.

May import: api only.
"""
