"""PyAV: FFmpeg through its Python bindings, seeking by keyframe timestamps.

PyAV does not apply the display-matrix rotation (`frame.rotation` reports it),
so frames are rotated here, the way OpenCV and torchcodec show them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from vlmbatch.media.video.base import VideoBackend, walk_frames
from vlmbatch.media.video.options import VideoOptions, cpu_decoder_threads
from vlmbatch.media.video.probe import StreamIndex, open_container
from vlmbatch.media.video.sampling import nearest_frame
from vlmbatch.media.refs import MediaSource


def rotate_to_display(frame: np.ndarray, rotation: int) -> np.ndarray:
    """Apply a display rotation given in FFmpeg's degrees (counter-clockwise)."""
    turns = (int(rotation) // 90) % 4
    return np.ascontiguousarray(np.rot90(frame, turns)) if turns else frame


class PyAVBackend(VideoBackend):
    name = "pyav"

    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        with open_container(source) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if cpu_decoder_threads():
                stream.thread_count = cpu_decoder_threads()
            start = stream.start_time or 0
            time_base = stream.time_base

            def frames_from(keyframe: int, target: int) -> Iterator[tuple[int, Any]]:
                if keyframe > 0:
                    pts = start + int(round(index.timestamps[keyframe] / time_base))
                    container.seek(pts, stream=stream, backward=True)
                for frame in _decoded(container, stream):
                    if frame.pts is None:
                        continue
                    position = nearest_frame(index.timestamps, float((frame.pts - start) * time_base))
                    yield position, lambda frame=frame: rotate_to_display(frame.to_ndarray(format="rgb24"), frame.rotation)

            return walk_frames(wanted, index, frames_from)


def _decoded(container: Any, stream: Any) -> Iterator[Any]:
    """Decoded frames, skipping packets the decoder rejects (damaged data)."""
    import av

    for packet in container.demux(stream):
        try:
            yield from packet.decode()
        except av.InvalidDataError:
            continue
