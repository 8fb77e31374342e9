"""LLaVA-OneVision: LLaVA-NeXT's `<image>` tiling, plus `<video>` and the multi-image rule.

As the model was trained, and as `transformers` does when a prompt's images are passed as
one list: a lone image is tiled (anyres), but each image of a multi-image prompt is only
its base view, padded to a square, `num_image_tokens` + 1 (`image_newline`) tokens. A video
is its frames resized to one tile, each pooled 2x2 after the projector, plus one newline.

Frames arrive already sampled (`media/video/sampling.py`, under `LLAVA_ONEVISION_FRAMES`),
so the processor must not sample again. The first image item of a prompt carries the
prompt's `batch_num_images` (the processor's per-prompt output), so collated items give
`generate()` the same rule.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.families.llava_next.adapter import LlavaNextAdapter
from vlmbatch.families.processor_adapter import sampled_video_inputs
from vlmbatch.families.prompt import VIDEO, MediaItem
from vlmbatch.media.types import VideoFrames
from vlmbatch.media.video.sampling import FrameConvention

# The model card's video inference: 32 frames uniformly over the clip (fewer frames of a
# shorter clip, no repeats); `media_io_kwargs` `num_frames` / `max_frames` change it.
LLAVA_ONEVISION_FRAMES = FrameConvention(fps=1.0, frame_factor=1, min_frames=32, max_frames=32)


class LlavaOnevisionAdapter(LlavaNextAdapter):
    video_token = "<video>"
    video_placeholder = "<video>"
    extra_eos_tokens = ("<|im_end|>", "<|endoftext|>")
    frame_convention = LLAVA_ONEVISION_FRAMES

    def tiles_images(self, num_images: int) -> bool:
        return num_images == 1

    def _image_inputs(self, images: list[Any]) -> Any:
        return [images] if images else None  # one prompt's list: the processor applies the multi-image rule

    def _image_token_counts(self, sizes: list[tuple[int, int]], processor_kwargs: dict[str, Any] | None = None) -> list[int]:
        if len(sizes) < 2:
            return super()._image_token_counts(sizes, processor_kwargs)
        base = self.processor.num_image_tokens + 1 - (self.processor.vision_feature_select_strategy == "default")
        return [base] * len(sizes)

    def _video_inputs(self, videos: list[VideoFrames]) -> dict[str, Any]:
        return sampled_video_inputs(videos) if videos else {}

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        items = self.image_items(processed, hashes) if "pixel_values" in processed else []
        if items:
            items[0].tensors["batch_num_images"] = torch.tensor([len(items)])
        for video in processed.get("pixel_values_videos", []):
            frames, _, height, width = video.shape
            count = self.processor._get_num_multimodal_tokens(video_sizes=[(frames, height, width)]).num_video_tokens[0]
            items.append(MediaItem(VIDEO, {"pixel_values_videos": video.unsqueeze(0)}, count, hashes[len(items)]))
        return items


ADAPTER = LlavaOnevisionAdapter
