"""InternVL3 / InternVL3.5 in the paged engine: the checkpoint's InternViT tower, pixel shuffle
and MLP projector (`transformers`' own `get_image_features`, one batch of tiles per step),
a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) decoder with 1-D RoPE."""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.engine.vision_language import VisionLanguageModel, on_device, pooled
from vlmbatch.families.prompt import IMAGE, MediaItem


class InternVLModel(VisionLanguageModel):
    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        if text_config.model_type == "qwen2":
            return DecoderSpec(qkv_bias=True)  # Qwen2's q/k/v projections always have biases
        if text_config.model_type == "qwen3":
            return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True)
        raise ValueError(f"InternVL with a {text_config.model_type!r} language model is not supported (qwen2, qwen3 are)")

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """Every tile of the items in one tower call: [tiles * image_seq_length, hidden]."""
        pixels = on_device(items, "pixel_values", self.device).to(self.hf.dtype)
        return pooled(self.hf.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        ))


ENGINE_MODEL = InternVLModel
