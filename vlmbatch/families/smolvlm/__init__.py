"""SmolVLM / SmolVLM2 (`model_type` smolvlm; SmolVLM-256M/500M/2.2B, SmolVLM2-256M/500M/2.2B):
Idefics3's architecture (its engine model) with SmolVLM's processor; SmolVLM2 takes video."""

from vlmbatch.families.idefics3.model import ENGINE_MODEL
from vlmbatch.families.smolvlm.adapter import ADAPTER
from vlmbatch.families.smolvlm.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
