"""The engine's own decoders and the per-family multimodal front ends around them."""
