"""The typed contract between media, model families and engines.

A family's adapter turns (prompt, decoded images, sampled video frames) into a
`PreparedPrompt`: token ids plus one `MediaItem` per image or video, in prompt order.
Engines only ever see these, so they stay independent of how each family builds its
prompts. An item carries either the processor's tensors for that item alone, or the
encoded bytes of a JPEG that the engine decodes on its GPU (`EncodedImage`); nothing
travels under magic keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vlmbatch.media.types import EncodedImage

IMAGE, VIDEO = "image", "video"


@dataclass
class MediaItem:
    """One image or video of a request.

    `tensors` are the processor's outputs for this item alone, batched on dim 0 so that
    collating items is a concatenation (Qwen: `pixel_values` [patches, C*T*P*P] and
    `image_grid_thw` [1, 3]; LLaVA: `pixel_values` [1, 3, H, W]). An item still `encoded`
    holds only what the engine needs before its pixels exist (Qwen: the grid). `num_tokens`
    is how many placeholder tokens of the prompt the item fills; `content_hash` keys the
    encoder and prefix caches, so equal content shares them whatever its source.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    num_tokens: int
    content_hash: str
    encoded: EncodedImage | None = None

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> MediaItem:
        """A decoded copy: `tensors` added, the encoded bytes dropped."""
        return replace(self, tensors={**self.tensors, **tensors}, encoded=None)

    @property
    def device_bytes(self) -> int:
        """Bytes of this item's tensors that are not in host memory (frames of GPU decoders)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if t.device.type != "cpu")

    def cast_pixels(self, dtype: torch.dtype | str, on_device_only: bool = False) -> None:
        """Cast the floating `pixel_values*` tensors to `dtype` in place: the vision towers
        cast pixels to their weights' dtype first thing, so doing it earlier changes no
        result and halves what bf16/fp16 engines copy and hold. `on_device_only` leaves host
        tensors alone (the engine's thread should not spend CPU on them)."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        for key, value in self.tensors.items():
            if key.startswith("pixel_values") and value.is_floating_point():
                if not on_device_only or value.device.type != "cpu":
                    self.tensors[key] = value.to(dtype)


@dataclass
class PreparedPrompt:
    """One request, ready for an engine: token ids (media placeholders expanded) and its media."""

    prompt_token_ids: list[int]
    media: list[MediaItem] = field(default_factory=list)
    prompt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def device_media_bytes(self) -> int:
        return sum(item.device_bytes for item in self.media)


def collate(items: list[MediaItem]) -> dict[str, Any]:
    """The items' tensors in the processor's batch layout: each key concatenated on dim 0,
    in item order (what `transformers`' model forward takes). Items must be decoded."""
    if any(item.encoded is not None for item in items):
        raise ValueError("collate needs decoded media items")
    keys = dict.fromkeys(key for item in items for key in item.tensors)
    return {key: torch.cat([item.tensors[key] for item in items if key in item.tensors]) for key in keys}
