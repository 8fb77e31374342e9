"""Idefics3 / SmolVLM in the paged engine: our SigLIP tower (`families/siglip_tower.py`) on the
checkpoint's weights and its pixel-shuffle connector on every tile of a step at once, a
Llama decoder with 1-D RoPE."""

from __future__ import annotations

import torch

from vlmbatch.engine.vision_language import VisionLanguageModel
from vlmbatch.families.prompt import IMAGE, MediaItem
from vlmbatch.families.siglip_tower import SiglipTower


class Idefics3Model(SiglipTower, VisionLanguageModel):
    language_model_attr = "text_model"
    siglip_attr = "vision_model"

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """Every tile is a full square (the processor pads nothing inside one), so the tower
        runs without a patch mask, as `transformers` runs it on unpadded tiles (every patch at
        its bucketed position id, all attending to each other): what ours does."""
        pixels = self.on_device(items, "pixel_values").to(self.hf.dtype)
        hidden = self.vision_hidden(pixels)
        features = self.hf.model.connector(hidden)
        return features.reshape(-1, features.shape[-1])


ENGINE_MODEL = Idefics3Model
