"""LLaVA-OneVision in the paged engine: LLaVA-NeXT's tiles and tower, OneVision's packing
(grids above `vision_aspect_ratio`'s tile budget downsampled bilinearly, base-only images
of multi-image prompts with one newline), and videos: every frame of a step's videos
through the tower in one batch, pooled 2x2 by `transformers`' own `apply_pooling`, then
one `image_newline` per video, as `get_video_features` does. The tower is ours
(`families/siglip_tower.py`, only the layers up to `vision_feature_layer`) where the
checkpoint's is SigLIP, as the released ones are."""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.families.llava_next.model import LlavaNextModel
from vlmbatch.families.prompt import IMAGE, VIDEO, MediaItem
from vlmbatch.families.siglip_tower import SiglipTower


class LlavaOnevisionModel(SiglipTower, LlavaNextModel):
    @classmethod
    def feature_layers(cls, config: Any) -> int | list[int]:
        return config.vision_feature_layer

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        return {IMAGE: self.config.image_token_id, VIDEO: self.config.video_token_id}

    def pack(self, tiles: list[torch.Tensor], image_sizes: torch.Tensor) -> list[torch.Tensor]:
        packed, _ = self.hf.model.pack_image_features(
            tiles, image_sizes, image_newline=self.hf.model.image_newline, vision_aspect_ratio=self.config.vision_aspect_ratio
        )
        return packed

    def encode_batch(self, kind: str, items: list[MediaItem]) -> torch.Tensor:
        if kind == IMAGE:
            return super().encode_batch(kind, items)
        videos = [self.on_device([item], "pixel_values_videos").flatten(0, 1) for item in items]
        frames = self.hf.model.apply_pooling(self.tile_features(torch.cat(videos).to(self.hf.dtype)))
        newline = self.hf.model.image_newline[None].to(frames.dtype)
        return torch.cat([torch.cat([video.flatten(0, 1), newline]) for video in frames.split([len(v) for v in videos])])


ENGINE_MODEL = LlavaOnevisionModel
