"""NVIDIA DeepStream (`nvidia-deepstream-videodecode`): NVDEC through GStreamer, frames on the GPU.

Written against the package's documented API (`DecodePool(num_workers)`,
`pool.decode(data, target_indices=..., max_frames=..., timeout_sec=...)`
returning `DecodeFrames(frames, n_kept, n_total, fps, error)`); it needs an
NVIDIA driver >= 590 and GStreamer system packages, which the lent H200 lacks,
so only the option handling and pool sizing are tested (on the CPU).

One decode pool per process, sized by the first request's `pool_size`
(clamped to [1, 16]); later values are ignored, as documented.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.base import fill_missing
from vlmbatch.media.video.gpu import DeviceFramesBackend, ProcessResource, display_rotation, rotate_frame
from vlmbatch.media.video.options import VideoOptions
from vlmbatch.media.video.probe import StreamIndex
from vlmbatch.media.refs import MediaSource

DECODE_TIMEOUT_S = 120.0


def _build_pool(size: int) -> Any:
    from nvidia.deepstream_videodecode import DecodePool

    return DecodePool(num_workers=size)


DECODE_POOL: ProcessResource[Any] = ProcessResource("pool_size", strict=False)


class DeepStreamBackend(DeviceFramesBackend):
    name = "deepstream"

    def reserve(self, options: VideoOptions) -> Any:
        return DECODE_POOL.get(options.pool_size, _build_pool)

    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        pool = self.reserve(options)
        data = source.data if source.data is not None else Path(source.path).read_bytes()
        result = pool.decode(data, target_indices=list(wanted), max_frames=len(wanted), timeout_sec=DECODE_TIMEOUT_S)
        if result.error:
            raise RowError(ErrorType.MEDIA_DECODE, f"DeepStream could not decode {source.name}: {result.error}")
        rotation = display_rotation(source)
        kept = list(wanted)[: result.n_kept]  # frames come back in the order asked, up to the first failure
        frames = {i: rotate_frame(result.frames[position], rotation) for position, i in enumerate(kept)}
        return fill_missing(frames, wanted)
