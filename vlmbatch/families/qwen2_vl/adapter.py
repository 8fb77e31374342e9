"""Qwen2-VL and Qwen2.5-VL: ChatML prompts with `<|vision_start|><|image_pad|><|vision_end|>` placeholders.

Videos arrive already sampled (`VideoFrames`), so the processor must not sample again, and
it must know the real sampling rate: Qwen2.5-VL's temporal M-RoPE positions come from
`second_per_grid_ts` = temporal_patch_size / fps.

Frames from GPU decoders (CUDA tensors) are handed to the processor as they are, with
`device=` their device: the processor's torch code resizes and normalises them there, so
`pixel_values_videos` come out on the GPU with no host round trip (as `gpu_image` does for
images). CPU frames (numpy) take the processor's usual path, unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vlmbatch.families.processor_adapter import ProcessorAdapter, sampled_video_inputs
from vlmbatch.families.prompt import IMAGE, VIDEO, MediaItem
from vlmbatch.media.types import EncodedImage, VideoFrames

# (kind, pixels key, grid key) of the processor's outputs, images before videos.
_KINDS = ((IMAGE, "pixel_values", "image_grid_thw"), (VIDEO, "pixel_values_videos", "video_grid_thw"))


class Qwen2VLAdapter(ProcessorAdapter):
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
    extra_eos_tokens = ("<|im_end|>", "<|endoftext|>")

    def _video_inputs(self, videos: list[VideoFrames]) -> dict[str, Any]:
        if not videos:
            return {}
        from transformers.video_utils import VideoMetadata

        kwargs = sampled_video_inputs(videos)
        kwargs["video_metadata"] = [VideoMetadata(**self._video_metadata(v, a)) for v, a in zip(videos, kwargs["videos"])]
        if getattr(self.processor.video_processor, "cap_pixels_per_frame", False) is None:
            # transformers >= 5.20 asks us to choose: take qwen-vl-utils' bounded per-frame pixels.
            kwargs["cap_pixels_per_frame"] = True
        return kwargs

    @staticmethod
    def _video_metadata(video: VideoFrames, frames: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """fps is the rate the frames were sampled at, which the processor turns into
        `second_per_grid_ts`; indices are positions in this frame list."""
        return dict(total_num_frames=len(frames), fps=video.sampled_fps, width=frames.shape[2], height=frames.shape[1],
                    duration=video.duration, frames_indices=list(range(len(frames))))

    def media_items(self, processed: dict[str, torch.Tensor], hashes: list[str]) -> list[MediaItem]:
        """One item per grid: its patch rows of the pixels, its grid, and for a video its
        `second_per_grid_ts` (temporal M-RoPE positions come from it)."""
        merge = self.config.vision_config.spatial_merge_size ** 2
        items: list[MediaItem] = []
        for kind, pixels_key, grid_key in _KINDS:
            grids = processed.get(grid_key)
            if grids is None:
                continue
            seconds = processed.get("second_per_grid_ts")
            for i, (grid, pixels) in enumerate(zip(grids, processed[pixels_key].split(grids.prod(-1).tolist()))):
                tensors = {pixels_key: pixels, grid_key: grid.unsqueeze(0)}
                if kind == VIDEO and seconds is not None:
                    tensors["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[i : i + 1]
                items.append(MediaItem(kind, tensors, int(grid.prod()) // merge, hashes[len(items)]))
        return items

    def _encoded_tensors(self, image: EncodedImage) -> dict[str, torch.Tensor]:
        """The image's (1, h, w) patch grid, exactly as the image processor derives it
        (`smart_resize` with its pixel bounds, patch and merge sizes): M-RoPE positions and
        the token count come from it before the pixels exist."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        ip = self.processor.image_processor
        patch = ip.patch_size
        height, width = smart_resize(
            image.height, image.width, patch * ip.merge_size,
            min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"],
        )
        return {"image_grid_thw": torch.tensor([[1, height // patch, width // patch]], dtype=torch.int64)}


ADAPTER = Qwen2VLAdapter
