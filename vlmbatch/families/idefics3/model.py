"""Idefics3 / SmolVLM in the paged engine: the checkpoint's SigLIP-style tower and pixel-shuffle
connector on every tile of a step at once, a Llama decoder with 1-D RoPE."""

from __future__ import annotations

import torch

from vlmbatch.engine.vision_language import VisionLanguageModel, on_device
from vlmbatch.families.prompt import IMAGE, MediaItem


class Idefics3Model(VisionLanguageModel):
    language_model_attr = "text_model"

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """Every tile is a full square (the processor pads nothing inside one), so the tower
        runs without a patch mask, as `transformers` runs it on unpadded tiles."""
        pixels = on_device(items, "pixel_values", self.device).to(self.hf.dtype)
        hidden = self.hf.model.vision_model(pixel_values=pixels).last_hidden_state
        features = self.hf.model.connector(hidden)
        return features.reshape(-1, features.shape[-1])


ENGINE_MODEL = Idefics3Model
