"""LLaVA-1.5: `USER: <image>\\n... ASSISTANT:` prompts, one CLIP crop per image, no video."""

from __future__ import annotations

from vlmbatch.models.processor_adapter import ProcessorAdapter


class LlavaAdapter(ProcessorAdapter):
    family = "llava"
    supports_video = False
    image_token = "<image>"
    image_placeholder = "<image>"
