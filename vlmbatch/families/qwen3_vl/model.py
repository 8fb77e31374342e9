"""Qwen3-VL in the paged engine: our own vision tower with DeepStack (`vision.py`) in place of
`transformers`', a Qwen3 decoder (per-head q/k RMSNorms, no biases) with interleaved M-RoPE.

The tower returns the merged features and one more set per `deepstack_visual_indexes`
block, side by side, so the encoder cache and the prefill step carry them together, and
the decoder adds level i after its layer i.
"""

from __future__ import annotations

from typing import Any

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.families.qwen2_vl.model import QwenVL
from vlmbatch.families.qwen3_vl.vision import Qwen3VisionTower


class Qwen3VLModel(QwenVL):
    mrope_interleaved = True
    tower_class = Qwen3VisionTower

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deepstack_levels = len(self.config.vision_config.deepstack_visual_indexes)

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True)


ENGINE_MODEL = Qwen3VLModel
