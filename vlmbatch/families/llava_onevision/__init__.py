"""LLaVA-OneVision (`model_type` llava_onevision; llava-onevision-qwen2-0.5b/7b/72b): LLaVA-NeXT's
tiling with `anyres_max_9`, base-only images in multi-image prompts, pooled videos, a SigLIP
tower and a Qwen2 decoder."""

from vlmbatch.families.llava_onevision.adapter import ADAPTER
from vlmbatch.families.llava_onevision.model import ENGINE_MODEL
from vlmbatch.families.llava_onevision.tiny import make_tiny_checkpoint

__all__ = ["ADAPTER", "ENGINE_MODEL", "make_tiny_checkpoint"]
