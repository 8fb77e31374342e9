"""LLaVA-1.5 (`model_type` llava): `USER: <image>\\n... ASSISTANT:` prompts, images only."""

from vlmbatch.families.llava.adapter import ADAPTER
from vlmbatch.families.llava.model import ENGINE_MODEL
from vlmbatch.families.llava.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
