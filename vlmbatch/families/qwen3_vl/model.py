"""Qwen3-VL in the paged engine: the checkpoint's vision tower with DeepStack, a Qwen3 decoder
(per-head q/k RMSNorms, no biases) with interleaved M-RoPE.

The tower returns the merged features and one more set per `deepstack_visual_indexes`
block; `encode_batch` lays them side by side so the encoder cache and the prefill step
carry them together, and the decoder adds level i after its layer i.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.engine.decoder import DecoderSpec
from vlmbatch.engine.layers.segment_attention import use_packed_attention
from vlmbatch.families.qwen2_vl.model import QwenVL


class Qwen3VLModel(QwenVL):
    mrope_interleaved = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deepstack_levels = len(self.config.vision_config.deepstack_visual_indexes)
        self.packed_vision_attention = use_packed_attention(self.hf.model.visual)

    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True)

    def tower_features(self, kind: str, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        output = self.hf.model.get_image_features(pixels, grids.to(self.device), return_dict=True)
        levels = [torch.cat(level) for level in output.deepstack_features]
        return torch.cat([torch.cat(output.pooler_output), *levels], dim=-1)


ENGINE_MODEL = Qwen3VLModel
