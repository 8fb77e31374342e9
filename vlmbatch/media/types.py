"""Decoded media as passed from `vlmbatch.media` to the model adapters."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VideoFrames:
    """Frames sampled from one video, in presentation order.

    `frames` is a uint8 RGB array or tensor of shape (T, H, W, 3); it may live on a
    CUDA device when a GPU decoder produced it. `timestamps` are the frames' real
    presentation times in seconds (so variable-frame-rate files sample correctly);
    `sampled_fps` is the rate the sampler aimed for (Qwen2.5-VL derives
    `second_per_grid_ts` from it).
    """

    frames: Any
    timestamps: list[float]
    sampled_fps: float
    source_fps: float
    duration: float
    frame_indices: list[int] = field(default_factory=list)
    backend: str = ""

    @property
    def num_frames(self) -> int:
        return len(self.timestamps)


@dataclass(frozen=True)
class EncodedImage:
    """A validated JPEG whose decoding is left to the engine (nvJPEG on its GPU), with its
    upright size: the prompt's tokens were counted from it before the pixels exist."""

    data: bytes
    width: int
    height: int

    @property
    def content_hash(self) -> str:
        """Keyed on the encoded bytes (the pixels are not known yet); encoder caches use it."""
        return "jpeg:" + hashlib.blake2b(self.data, digest_size=16).hexdigest()
