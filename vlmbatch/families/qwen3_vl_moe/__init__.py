"""Qwen3-VL-MoE (`model_type` qwen3_vl_moe; Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL with a
mixture-of-experts decoder."""

from vlmbatch.families.qwen3_vl.adapter import ADAPTER
from vlmbatch.families.qwen3_vl_moe.model import ENGINE_MODEL
from vlmbatch.families.qwen3_vl_moe.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
