"""Tool calling: reading the calls a model wrote (forced by a grammar, or in its chat template's native format)."""
