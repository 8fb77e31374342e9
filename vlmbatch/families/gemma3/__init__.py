"""Gemma 3 (`model_type` gemma3): SigLIP + pooling projector, sliding-window/global decoder layers, images only."""

from vlmbatch.families.gemma3.adapter import ADAPTER
from vlmbatch.families.gemma3.model import ENGINE_MODEL
from vlmbatch.families.gemma3.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
