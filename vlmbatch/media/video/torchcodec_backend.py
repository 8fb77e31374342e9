"""torchcodec: FFmpeg through PyTorch's decoder, which plans seeks for a batch of indices.

`seek_mode="exact"` (default) scans the file once so frame indices are exact;
`"approximate"` trusts the container's metadata and skips the scan: faster to
open, but wrong on variable-frame-rate files (indices are then computed from
the average rate) and past the header's duration. `num_ffmpeg_threads` 0
lets FFmpeg pick. torchcodec stops at a packet the decoder rejects, so a
damaged file is decoded frame by frame, each bad frame replaced by the next
good one as the other backends do (a fresh decoder after each failure: the
old one returns shifted frames once a packet was rejected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.base import VideoBackend, fill_missing
from vlmbatch.media.video.options import VideoOptions, cpu_decoder_threads
from vlmbatch.media.video.probe import StreamIndex
from vlmbatch.media.refs import MediaSource


class TorchCodecBackend(VideoBackend):
    name = "torchcodec"

    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        from torchcodec.decoders import VideoDecoder

        def open_decoder() -> Any:
            try:
                return VideoDecoder(
                    source.path if source.path is not None else source.data,
                    dimension_order="NHWC",
                    num_ffmpeg_threads=options.num_ffmpeg_threads or cpu_decoder_threads(),
                    seek_mode=options.seek_mode,
                )
            except (RuntimeError, ValueError) as exc:
                raise RowError(ErrorType.MEDIA_DECODE, f"torchcodec cannot open {source.name}: {exc}") from exc

        try:
            batch = open_decoder().get_frames_at(indices=list(wanted)).data.numpy()
            return dict(zip(wanted, batch))
        except (RuntimeError, IndexError):
            return _one_by_one(open_decoder, wanted, index.num_frames)


def _one_by_one(open_decoder: Callable[[], Any], wanted: Sequence[int], num_frames: int) -> dict[int, Any]:
    frames: dict[int, Any] = {}
    decoder = open_decoder()
    for target in wanted:
        for candidate in range(target, num_frames):
            try:
                frames[target] = decoder.get_frame_at(candidate).data.numpy()
                break
            except (RuntimeError, IndexError):
                decoder = open_decoder()
    return fill_missing(frames, wanted)
