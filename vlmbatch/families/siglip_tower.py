"""The hookup of our SigLIP tower (`engine/layers/siglip.py`) in the families whose
`transformers` tower it replaces exactly: Gemma 3, LLaVA-OneVision (`SiglipVisionModel`),
Idefics3 / SmolVLM (their copy of it, run on full tiles without a patch mask) and, as
`tower_class` `InternVisionTower`, InternVL (`engine/layers/internvit.py`).

`SiglipTower` goes before the family's base class: once the model is built it builds ours
from the checkpoint's tower (`hf.model.<siglip_attr>`), drops `transformers`' one, and
hands `vision_hidden(pixels)` to the family's encoding; a tower `tower_class.rebuilds` refuses (a LLaVA-OneVision
checkpoint with a CLIP tower, InternViT-6B) keeps `transformers`' (`self.tower` None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vlmbatch.engine.layers.siglip import SiglipVisionTower, transformers_hidden


class SiglipTower:
    tower_class = SiglipVisionTower
    siglip_attr = "vision_tower"  # where `hf_model.model` holds the tower (Idefics3: vision_model)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        weight = self.decoder.embed_tokens.weight
        self.tower = self.siglip_from_hf(self.hf, weight.device, weight.dtype)
        if self.tower is not None:
            setattr(self.hf.model, self.siglip_attr, None)  # ours holds the weights now

    @classmethod
    def feature_layers(cls, config: Any) -> Sequence[int] | None:
        """The tower's hidden states the family reads; None: the post-layernormed last layer."""
        return None

    @classmethod
    def siglip_from_hf(cls, hf_model: nn.Module, device: torch.device, dtype: torch.dtype) -> SiglipVisionTower | None:
        """Ours from the model's tower, or None where it is not one we rebuild."""
        vision = getattr(hf_model.model, cls.siglip_attr)
        if not cls.tower_class.rebuilds(vision):
            return None
        return cls.tower_class.from_hf(vision, device, dtype, cls.feature_layers(hf_model.config))

    @classmethod
    def transformers_hidden(cls, hf_model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return transformers_hidden(getattr(hf_model.model, cls.siglip_attr), pixels, cls._layers(hf_model.config))

    @classmethod
    def _layers(cls, config: Any) -> Sequence[int] | None:
        layers = cls.feature_layers(config)
        return (layers,) if isinstance(layers, int) else layers

    def vision_hidden(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's features [images, patches, hidden] of `pixels` [images, C, H, W]."""
        if self.tower is not None:
            return self.tower(pixels)
        return self.transformers_hidden(self.hf, pixels)

    def vision_modules(self) -> list[nn.Module]:
        return [self.tower, self.hf] if self.tower is not None else [self.hf]  # hf: the projector / connector
