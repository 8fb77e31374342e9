"""InternVL3 / InternVL3.5 (`model_type` internvl, HF-format checkpoints such as
OpenGVLab/InternVL3-8B-hf): ChatML prompts, images tiled by aspect ratio with a thumbnail,
videos as one tile per frame, InternViT + pixel shuffle + MLP, a Qwen2 or Qwen3 decoder."""

from vlmbatch.families.internvl.adapter import ADAPTER
from vlmbatch.families.internvl.model import ENGINE_MODEL
from vlmbatch.families.internvl.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
