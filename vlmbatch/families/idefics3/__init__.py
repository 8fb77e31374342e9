"""Idefics3 (`model_type` idefics3; Idefics3-8B-Llama3): images split into tiles plus a
global image, a pixel-shuffle connector, a Llama decoder; images only."""

from vlmbatch.families.idefics3.adapter import ADAPTER
from vlmbatch.families.idefics3.model import ENGINE_MODEL
from vlmbatch.families.idefics3.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
