"""The engine benchmark: pdserve against llama-server and transformers (`python -m bench.engine`)."""
