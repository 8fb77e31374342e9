"""Qwen2.5-VL (`model_type` qwen2_5_vl): Qwen2-VL's prompts and positions, a windowed vision
tower (ours in the paged engine) and absolute-time video positions."""

from vlmbatch.families.qwen2_5_vl.model import ENGINE_MODEL
from vlmbatch.families.qwen2_5_vl.tiny import make_tiny_checkpoint
from vlmbatch.families.qwen2_vl.adapter import ADAPTER

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
