"""Building blocks of the engine's own decoders (flat [num_tokens, ...] layouts, no batch dim)."""
