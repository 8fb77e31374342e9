"""LLaVA-NeXT (`model_type` llava_next; llava-v1.6 Mistral/Vicuna): anyres tiling by aspect
ratio with `image_newline`, a CLIP tower, a Mistral or Llama decoder; images only."""

from vlmbatch.families.llava_next.adapter import ADAPTER
from vlmbatch.families.llava_next.model import ENGINE_MODEL
from vlmbatch.families.llava_next.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
