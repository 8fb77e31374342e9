"""LLaVA-NeXT in the paged engine: the checkpoint's vision tower and projector over every
tile of a step's images in one batch, then `transformers`' own anyres packing (the tile
grid unpadded to the image's aspect ratio, `image_newline` after each row), and our
decoder (Mistral/Vicuna; Qwen2's q/k/v biases for OneVision).

`llava_onevision/model.py` builds on it: the same tower features, its own packing rule
(`anyres_max_9`), and videos.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.engine.vision_language import VisionLanguageModel
from vlmbatch.families.prompt import IMAGE, MediaItem


class LlavaNextModel(VisionLanguageModel):
    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        qwen2 = text_config.model_type == "qwen2"  # Qwen2's q/k/v projections always have biases
        return DecoderSpec(qkv_bias=qwen2 or bool(getattr(text_config, "attention_bias", False)))

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id}

    def tile_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Projected features [tiles, tokens, hidden] of tower-sized crops, selected as the
        config says (`vision_feature_layer`, CLS dropped by the "default" strategy); only the
        selected layer's hidden states are kept."""
        hidden = self.vision_hidden(pixels)
        if self.config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        return self.hf.model.multi_modal_projector(hidden)

    def vision_hidden(self, pixels: torch.Tensor) -> torch.Tensor:
        """`transformers`' tower's hidden states at `vision_feature_layer` (OneVision: ours)."""
        layer = self.config.vision_feature_layer
        states = self.hf.model.vision_tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        return states[layer] if isinstance(layer, int) else torch.cat([states[i] for i in layer], dim=-1)

    def pack(self, tiles: list[torch.Tensor], image_sizes: torch.Tensor) -> list[torch.Tensor]:
        """Each image's [tokens, hidden] from its tiles' features, by `transformers`' rule."""
        packed, _ = self.hf.model.pack_image_features(
            tiles, image_sizes, self.config.vision_feature_select_strategy, image_newline=self.hf.model.image_newline
        )
        return packed

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        pixels = self.on_device(items, "pixel_values").to(self.hf.dtype)
        tiles = self.tile_features(pixels).split([len(item.tensors["pixel_values"]) for item in items])
        sizes = torch.cat([item.tensors["image_sizes"] for item in items])  # host tensor: no device sync in packing
        return torch.cat(self.pack(list(tiles), sizes))


ENGINE_MODEL = LlavaNextModel
