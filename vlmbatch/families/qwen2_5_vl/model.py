"""Qwen2.5-VL in the paged engine: our own vision tower (`vision.py`) in place of `transformers`'."""

from __future__ import annotations

from vlmbatch.families.qwen2_5_vl.vision import QwenVisionTower
from vlmbatch.families.qwen2_vl.model import QwenVL


class Qwen25VLModel(QwenVL):
    """The same weights and arithmetic as `transformers`' tower, several times faster on the GPU."""

    tower_class = QwenVisionTower


ENGINE_MODEL = Qwen25VLModel
