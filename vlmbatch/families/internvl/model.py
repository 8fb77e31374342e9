"""InternVL3 / InternVL3.5 in the paged engine: our InternViT tower (`engine/layers/internvit.py`,
hooked in as the SigLIP families hook theirs) on the checkpoint's weights where it rebuilds
it exactly, else `transformers`' (InternViT-6B); then `transformers`' pixel shuffle and MLP
projector, one batch of tiles per step, in front of a Qwen2 (q/k/v biases) or Qwen3
(per-head q/k norms) decoder with 1-D RoPE."""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.engine.layers.internvit import InternVisionTower
from vlmbatch.families.llava.model import LlavaModel
from vlmbatch.families.prompt import MediaItem
from vlmbatch.families.siglip_tower import SiglipTower


class InternVLModel(SiglipTower, LlavaModel):
    tower_class = InternVisionTower

    @classmethod
    def feature_layers(cls, config: Any) -> tuple[int] | None:
        """`vision_feature_layer` -1 reads `last_hidden_state` (after the tower's final norm), any other one hidden state."""
        return None if config.vision_feature_layer == -1 else (config.vision_feature_layer,)

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        """The tiles through the tower, the CLS token dropped (select strategy "default"), then
        `transformers`' pixel shuffle and projector, as `get_image_features` does after its tower."""
        features = self.vision_hidden(self.on_device(items, "pixel_values").to(self.hf.dtype))
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:, :]
        side = int(features.shape[1] ** 0.5)
        shuffled = self.hf.model.pixel_shuffle(features.reshape(len(features), side, side, -1), scale_factor=self.config.downsample_ratio)
        projected = self.hf.model.multi_modal_projector(shuffled.reshape(len(features), -1, shuffled.shape[-1]))
        return projected.reshape(-1, projected.shape[-1])

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        if text_config.model_type == "qwen2":
            return DecoderSpec(qkv_bias=True)  # Qwen2's q/k/v projections always have biases
        if text_config.model_type == "qwen3":
            return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True)
        raise ValueError(f"InternVL with a {text_config.model_type!r} language model is not supported (qwen2, qwen3 are)")


ENGINE_MODEL = InternVLModel
