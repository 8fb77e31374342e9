"""The one place that decides which frames of a video are taken.

Frames are chosen from the stream's real presentation timestamps, not from
`index / fps`, so variable-frame-rate files are sampled evenly in time. Every
backend is then asked for exactly these frame indices, which is what makes
their outputs comparable frame for frame.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vlmbatch.media.video.options import VideoOptions


@dataclass(frozen=True)
class FrameConvention:
    """A model family's frame-sampling habits (defaults: Qwen2.5-VL / qwen-vl-utils).

    `frame_factor` is the vision tower's temporal patch size: the frame count is a
    multiple of it so no frame is wasted on padding.
    """

    fps: float = 2.0
    frame_factor: int = 2
    min_frames: int = 4
    max_frames: int = 768


QWEN2_5_VL = FrameConvention()


@dataclass(frozen=True)
class FramePlan:
    """Frames to decode: indices into the stream's frames in presentation order.

    Indices may repeat when a clip has fewer frames than the model needs.
    """

    indices: list[int]
    timestamps: list[float]
    sampled_fps: float
    duration: float


def stream_duration(timestamps: Sequence[float]) -> float:
    """Span of the stream: first to last timestamp plus one typical frame length (0 for one frame)."""
    if len(timestamps) < 2:
        return 0.0
    gaps = sorted(b - a for a, b in zip(timestamps, timestamps[1:]))
    return timestamps[-1] - timestamps[0] + gaps[len(gaps) // 2]


def nearest_frame(timestamps: Sequence[float], t: float) -> int:
    """Index of the frame whose timestamp is closest to `t` (earlier one on a tie)."""
    right = bisect.bisect_left(timestamps, t)
    if right == 0:
        return 0
    if right == len(timestamps):
        return len(timestamps) - 1
    return right if timestamps[right] - t < t - timestamps[right - 1] else right - 1


def _floor_to(value: float, factor: int) -> int:
    return int(math.floor(value / factor)) * factor


def _round_to(value: float, factor: int) -> int:
    return max(factor, int(round(value / factor)) * factor)


def plan_frames(
    timestamps: Sequence[float], options: VideoOptions, convention: FrameConvention = QWEN2_5_VL
) -> FramePlan:
    """Pick frames uniformly in time from `timestamps` (sorted seconds, one per frame).

    `num_frames` is rounded to the frame factor; otherwise the count follows
    `fps` (the convention's by default) over the clip's duration, clamped to
    [min_frames, max_frames]. `max_duration` keeps only the clip's beginning.
    """
    if not timestamps:
        raise ValueError("a video with no frames cannot be sampled")
    factor = convention.frame_factor
    if options.max_duration is not None:
        end = bisect.bisect_left(timestamps, timestamps[0] + options.max_duration)
        timestamps = timestamps[: max(1, end)]
    total = len(timestamps)
    duration = stream_duration(timestamps)
    max_frames = options.max_frames or convention.max_frames
    if options.num_frames is not None:
        count = _round_to(options.num_frames, factor)
    else:
        fps = options.fps or convention.fps
        min_frames = math.ceil((options.min_frames or convention.min_frames) / factor) * factor
        count = max(duration * fps, min_frames)
    count = _floor_to(min(count, max_frames, total), factor) or factor
    first, last = timestamps[0], timestamps[-1]
    if count > total:  # a clip shorter than one temporal patch: repeat frames
        indices = [round(i * (total - 1) / (count - 1)) for i in range(count)]
    else:
        step = (last - first) / (count - 1) if count > 1 else 0.0
        indices = [nearest_frame(timestamps, first + i * step) for i in range(count)]
    return FramePlan(
        indices=indices,
        timestamps=[timestamps[i] - first for i in indices],
        sampled_fps=count / duration if duration > 0 else float(convention.fps),
        duration=duration,
    )
