"""Qwen3-VL (`model_type` qwen3_vl; Qwen3-VL-2B/4B/8B/32B): Qwen's ChatML prompts, images and
timestamped videos, DeepStack, interleaved M-RoPE, a Qwen3 decoder."""

from vlmbatch.families.qwen3_vl.adapter import ADAPTER
from vlmbatch.families.qwen3_vl.model import ENGINE_MODEL
from vlmbatch.families.qwen3_vl.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
