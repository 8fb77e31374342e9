"""Frame timestamps and keyframe positions of a video stream, without decoding pixels.

The sampler needs every frame's real presentation time, and the seeking
backends need to know where keyframes are. Both come from the container's
packets (demuxing only: milliseconds even for long clips): through PyAV when it
is installed, else through OpenCV's raw-stream mode (`CAP_PROP_FORMAT = -1`,
the GPU machine's case). The two agree on intact files; on a file with a
damaged packet OpenCV's raw mode drops that packet, so indices shift there.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.refs import MediaSource


@dataclass(frozen=True)
class StreamIndex:
    """Timestamps (seconds from the stream's start, presentation order) of every frame.

    `keyframes` are indices into `timestamps` of frames a decoder can start at;
    empty when unknown (then backends decode sequentially).
    """

    timestamps: list[float]
    keyframes: list[int] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return len(self.timestamps)

    def source_fps(self) -> float:
        if self.num_frames < 2:
            return 0.0
        return (self.num_frames - 1) / (self.timestamps[-1] - self.timestamps[0])

    def keyframe_before(self, index: int) -> int:
        """The last keyframe at or before frame `index` (0 when unknown)."""
        start = 0
        for keyframe in self.keyframes:
            if keyframe > index:
                break
            start = keyframe
        return start


def no_frames(source: MediaSource) -> RowError:
    return RowError(ErrorType.MEDIA_DECODE, f"video {source.name} has no decodable video frames")


def probe_stream(source: MediaSource) -> StreamIndex:
    """Index the first video stream of `source` (PyAV demux, else OpenCV)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return _probe_with_opencv(source)
    return _probe_with_pyav(source)


def open_container(source: MediaSource) -> Any:
    """A PyAV container on a path or bytes; unreadable input is the row's decode error."""
    import av

    try:
        return av.open(source.path if source.path is not None else io.BytesIO(source.data))
    except av.FFmpegError as exc:
        raise RowError(ErrorType.MEDIA_DECODE, f"cannot open video {source.name}: {exc}") from exc


def _probe_with_pyav(source: MediaSource) -> StreamIndex:
    import av

    with open_container(source) as container:
        if not container.streams.video:
            raise RowError(ErrorType.MEDIA_DECODE, f"{source.name} has no video stream")
        stream = container.streams.video[0]
        start = stream.start_time or 0
        packets: list[tuple[int, bool]] = []
        try:
            for packet in container.demux(stream):
                pts = packet.pts if packet.pts is not None else packet.dts
                if pts is not None and packet.size > 0:
                    packets.append((pts, packet.is_keyframe))
        except av.FFmpegError:
            pass  # a damaged tail: index what was readable
        if not packets:
            raise no_frames(source)
        packets.sort()
        time_base = float(stream.time_base)
        return StreamIndex(
            timestamps=[(pts - start) * time_base for pts, _ in packets],
            keyframes=[i for i, (_, key) in enumerate(packets) if key],
        )


def _probe_with_opencv(source: MediaSource) -> StreamIndex:
    import cv2

    from vlmbatch.media.video.opencv_capture import grab_loop, open_capture

    with open_capture(source, raw_packets=True) as capture:
        packets = sorted(
            (capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0, bool(capture.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME)))
            for _ in grab_loop(capture)
        )
    if not packets:
        raise no_frames(source)
    return StreamIndex(
        timestamps=[t for t, _ in packets],
        keyframes=[i for i, (_, key) in enumerate(packets) if key],
    )
