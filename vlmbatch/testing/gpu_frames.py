"""The "GPU frames stay on the GPU" check, shared by the tests and the device script.

The same sampled frames go through a model adapter's `prepare` twice: as numpy (the CPU
backends' output, the reference) and as a tensor on `device` (what GPU backends return).
The prompts must be token-identical and the pixel tensors equal up to how torchvision's
resize rounds on each device.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from vlmbatch.media.types import VideoFrames

# Normalised units (divided by CLIP's std ~0.27): one level of 255 is ~0.015. On the CPU
# torchvision resizes uint8 in fixed point, on the GPU in float: measured on the H200
# (2026-11-30), max 0.146 on the test clip and 0.23-0.28 at Qwen2.5-VL's 720p frame sizes
# (a few pixels at sharp edges, ~15-20 levels), mean 0.0003. A colour or geometry mistake
# moves the mean by far more than its bound; the max bound is the images' (gpu_image.py).
MAX_ABS_DIFF = 0.35
MEAN_ABS_DIFF = 0.005
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|> What happens in this video?"


def compare_on_device(adapter: Any, video: VideoFrames, device: str | torch.device) -> dict[str, Any]:
    """Prepare `video` from host numpy frames and from frames on `device`; returns where
    `pixel_values_videos` ended up and how far it is from the host path's."""
    frames = video.frames
    host = frames.cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    reference = adapter.prepare(VIDEO_PROMPT, videos=[replace(video, frames=host)])
    on_device = adapter.prepare(VIDEO_PROMPT, videos=[replace(video, frames=torch.from_numpy(host).to(device))])
    ours, theirs = on_device.media[0], reference.media[0]
    pixels = ours.tensors["pixel_values_videos"]
    diff = (pixels.float().cpu() - theirs.tensors["pixel_values_videos"].float()).abs()
    return {
        "device": str(pixels.device),
        "frames": list(host.shape),
        "tokens_equal": on_device.prompt_token_ids == reference.prompt_token_ids,
        "grid_equal": torch.equal(ours.tensors["video_grid_thw"].cpu(), theirs.tensors["video_grid_thw"]),
        "hash_equal": ours.content_hash == theirs.content_hash,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
    }


def within_tolerance(result: dict[str, Any]) -> bool:
    return (
        result["tokens_equal"]
        and result["grid_equal"]
        and result["hash_equal"]
        and result["max_abs_diff"] <= MAX_ABS_DIFF
        and result["mean_abs_diff"] <= MEAN_ABS_DIFF
    )
