"""What every family shares to generate: the paged engine, the hf reference engine, `LLM`."""
