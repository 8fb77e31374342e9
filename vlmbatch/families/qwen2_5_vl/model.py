"""Qwen2.5-VL in the paged engine: our own vision tower (`vision.py`) in place of `transformers`'."""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.families.qwen2_5_vl.vision import QwenVisionTower
from vlmbatch.families.qwen2_vl.model import QwenVL


class Qwen25VLModel(QwenVL):
    """The same weights and arithmetic as `transformers`' tower, several times faster on the GPU."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        weight = self.decoder.embed_tokens.weight
        self.tower = QwenVisionTower.from_hf(self.hf.model.visual, weight.device, weight.dtype, self.kernels)
        self.hf.model.visual = None  # ours holds the weights now

    def vision_modules(self) -> list[torch.nn.Module]:
        return [self.tower]

    def tower_features(self, kind: str, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        return self.tower(pixels, grids)


ENGINE_MODEL = Qwen25VLModel
