"""LLaVA-1.5: `USER: <image>\\n... ASSISTANT:` prompts, one CLIP crop per image, no video."""

from __future__ import annotations

import torch

from vlmbatch.families.processor_adapter import ProcessorAdapter
from vlmbatch.families.prompt import IMAGE, MediaItem


class LlavaAdapter(ProcessorAdapter):
    image_token = "<image>"
    image_placeholder = "<image>"

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """One fixed-size crop per image, `image_seq_length` tokens each."""
        tokens = int(self.config.image_seq_length)
        return [MediaItem(IMAGE, {"pixel_values": p.unsqueeze(0)}, tokens, h) for p, h in zip(processed["pixel_values"], hashes)]


ADAPTER = LlavaAdapter
