"""Qwen2-VL and Qwen2.5-VL: ChatML prompts with `<|vision_start|><|image_pad|><|vision_end|>` placeholders.

Videos arrive already sampled (`VideoFrames`), so the processor must not sample again, and
it must know the real sampling rate: Qwen2.5-VL's temporal M-RoPE positions come from
`second_per_grid_ts` = temporal_patch_size / fps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vlmbatch.media.types import VideoFrames
from vlmbatch.models.processor_adapter import ProcessorAdapter


def _frames_array(video: VideoFrames) -> np.ndarray:
    frames = video.frames
    return frames.cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)


class Qwen2VLAdapter(ProcessorAdapter):
    family = "qwen2_vl"
    supports_video = True
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"
    extra_eos_tokens = ("<|im_end|>", "<|endoftext|>")

    def _video_inputs(self, videos: list[VideoFrames]) -> dict[str, Any]:
        if not videos:
            return {}
        from transformers.video_utils import VideoMetadata

        arrays = [_frames_array(v) for v in videos]
        metadata = [
            # fps is the rate the frames were sampled at, which is what the processor
            # turns into second_per_grid_ts; indices are positions in this frame list.
            VideoMetadata(
                total_num_frames=len(a),
                fps=v.sampled_fps,
                width=a.shape[2],
                height=a.shape[1],
                duration=v.duration,
                frames_indices=list(range(len(a))),
            )
            for v, a in zip(videos, arrays)
        ]
        kwargs: dict[str, Any] = {"videos": arrays, "video_metadata": metadata, "do_sample_frames": False}
        if getattr(self.processor.video_processor, "cap_pixels_per_frame", False) is None:
            # transformers >= 5.20 asks us to choose: take qwen-vl-utils' bounded per-frame pixels.
            kwargs["cap_pixels_per_frame"] = True
        return kwargs


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    family = "qwen2_5_vl"
