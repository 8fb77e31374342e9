"""LLaVA-1.5 in the paged engine: the checkpoint's CLIP tower and projector, a Llama decoder with 1-D RoPE."""

from __future__ import annotations

import torch

from vlmbatch.engine.vision_language import VisionLanguageModel, pooled
from vlmbatch.families.prompt import IMAGE, MediaItem


class LlavaModel(VisionLanguageModel):
    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        pixels = self.on_device(items, "pixel_values").to(self.hf.dtype)
        return pooled(self.hf.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        ))


ENGINE_MODEL = LlavaModel
