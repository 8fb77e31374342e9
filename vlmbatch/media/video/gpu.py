"""Pieces the GPU backends share: the per-process decoder resource, colour conversion, device frames.

Frames decoded by NVDEC stay on the GPU: conversion, rotation and stacking are
torch operations on the decoder's device, so the engine gets CUDA tensors
without a round trip through host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.base import VideoBackend

T = TypeVar("T")


class ProcessResource(Generic[T]):
    """A resource sized once per process (decoder slots, a decode pool).

    The first caller's size builds it. Later callers asking for another size
    either get the existing one (`strict=False`: "the first value wins") or a
    row error (`strict=True`: the size was reserved at start-up and cannot change).
    """

    def __init__(self, option: str, strict: bool):
        self.option = option
        self.strict = strict
        self.size: int | None = None
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self, size: int, build: Callable[[int], T]) -> T:
        with self._lock:
            if self._value is None:
                self._value, self.size = build(size), size
            elif size != self.size and self.strict:
                raise RowError(
                    ErrorType.INVALID_ROW,
                    f"video option {self.option!r}={size} differs from the {self.size} this process reserved at start-up",
                    "media_io_kwargs",
                )
            return self._value


# Y'CbCr -> R'G'B' coefficients (Kr, Kb) per ITU recommendation.
_MATRICES = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}


def yuv_to_rgb(y: Any, u: Any, v: Any, matrix: str = "bt601", full_range: bool = False) -> Any:
    """RGB uint8 (H, W, 3) from full-resolution Y, U, V planes (uint8 tensors, same device).

    Defaults are FFmpeg's for an untagged 8-bit stream (and what OpenCV always
    uses): BT.601 coefficients, limited ("TV", 16-235) range. Rounded like swscale.
    """
    import torch

    kr, kb = _MATRICES[matrix]
    kg = 1.0 - kr - kb
    luma = y.float()
    cb, cr = u.float() - 128.0, v.float() - 128.0
    if not full_range:
        luma = (luma - 16.0) * (255.0 / 219.0)
        cb, cr = cb * (255.0 / 224.0), cr * (255.0 / 224.0)
    red = luma + 2.0 * (1.0 - kr) * cr
    blue = luma + 2.0 * (1.0 - kb) * cb
    green = luma - (2.0 * kb * (1.0 - kb) / kg) * cb - (2.0 * kr * (1.0 - kr) / kg) * cr
    return torch.stack([red, green, blue], dim=-1).round_().clamp_(0, 255).to(torch.uint8)


def nv12_to_rgb(nv12: Any, matrix: str = "bt601", full_range: bool = False) -> Any:
    """RGB (H, W, 3) from an NV12 surface: (H * 3/2, W) uint8, luma then interleaved UV.

    Chroma is repeated to full size (no interpolation), as swscale's unscaled
    yuv420p -> rgb24 path does, so edges match the CPU decoders.
    """
    height = nv12.shape[0] * 2 // 3
    y = nv12[:height]
    uv = nv12[height:].reshape(height // 2, -1, 2)
    u = uv[..., 0].repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)[:, : y.shape[1]]
    v = uv[..., 1].repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)[:, : y.shape[1]]
    return yuv_to_rgb(y, u, v, matrix, full_range)


def rotate_frame(frame: Any, rotation: int) -> Any:
    """Display rotation (FFmpeg's counter-clockwise degrees) of an (H, W, 3) tensor."""
    import torch

    turns = (int(rotation) // 90) % 4
    return torch.rot90(frame, turns, dims=(0, 1)).contiguous() if turns else frame


class DeviceFramesBackend(VideoBackend):
    """A backend whose frames are CUDA tensors: stacked on the device, never copied to the host."""

    def stack(self, frames: list[Any]) -> Any:
        import torch

        return torch.stack(frames)


def display_rotation(source: Any) -> int:
    """Counter-clockwise display rotation from the container's display matrix (0 if none).

    Read through OpenCV, which reports it clockwise (`CAP_PROP_ORIENTATION_META`;
    always 0 in raw-packet mode, hence a normal capture that only reads headers).
    """
    import cv2

    from vlmbatch.media.video.opencv_capture import open_capture

    with open_capture(source) as capture:
        clockwise = int(capture.get(cv2.CAP_PROP_ORIENTATION_META))
    return (360 - clockwise) % 360
