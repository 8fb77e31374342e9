"""InternVL3 / InternVL3.5 in the paged engine: the checkpoint's InternViT tower, pixel shuffle
and MLP projector through `transformers`' own `get_image_features` (LLaVA's hookup: one
batch of tiles per step, the placeholder id and feature layer from the config), in front
of a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) decoder with 1-D RoPE."""

from __future__ import annotations

from typing import Any

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.families.llava.model import LlavaModel


class InternVLModel(LlavaModel):
    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        if text_config.model_type == "qwen2":
            return DecoderSpec(qkv_bias=True)  # Qwen2's q/k/v projections always have biases
        if text_config.model_type == "qwen3":
            return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True)
        raise ValueError(f"InternVL with a {text_config.model_type!r} language model is not supported (qwen2, qwen3 are)")


ENGINE_MODEL = InternVLModel
