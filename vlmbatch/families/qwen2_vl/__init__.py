"""Qwen2-VL (`model_type` qwen2_vl): ChatML prompts with `<|vision_start|><|image_pad|><|vision_end|>`
placeholders, images and videos, M-RoPE."""

from vlmbatch.families.qwen2_vl.adapter import ADAPTER
from vlmbatch.families.qwen2_vl.model import ENGINE_MODEL
from vlmbatch.families.qwen2_vl.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
