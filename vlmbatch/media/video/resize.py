"""Shrink decoded frames to a pixel budget, the same way whichever backend decoded them."""

from __future__ import annotations

import math
from typing import Any


def target_size(height: int, width: int, max_pixels: int | None, max_side: int | None) -> tuple[int, int]:
    """The largest (height, width) with the same aspect ratio inside both caps."""
    scale = 1.0
    if max_pixels is not None and height * width > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
    if max_side is not None and max(height, width) * scale > max_side:
        scale = max_side / max(height, width)
    return max(1, int(height * scale)), max(1, int(width * scale))


def resize_frames(frames: Any, max_pixels: int | None, max_side: int | None) -> Any:
    """(T, H, W, 3) uint8 numpy array or torch tensor (CPU or CUDA) → same type, resized.

    One torch code path (antialiased bilinear in float32) serves CPU and GPU
    frames, so all backends shrink identically.
    """
    height, width = frames.shape[1], frames.shape[2]
    size = target_size(height, width, max_pixels, max_side)
    if size == (height, width):
        return frames
    import numpy as np
    import torch  # only now: importing torch costs seconds the CPU backends need not pay

    tensor = torch.from_numpy(frames) if isinstance(frames, np.ndarray) else frames
    scaled = torch.nn.functional.interpolate(
        tensor.permute(0, 3, 1, 2).float(), size=size, mode="bilinear", antialias=True, align_corners=False
    )
    result = scaled.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return result.numpy() if isinstance(frames, np.ndarray) else result
