"""OpenCV (its bundled FFmpeg): the default backend, a grab loop with keyframe seeks.

Traps avoided: `CAP_PROP_POS_FRAMES` counts frames as `pts * average fps`, so a
seek on a variable-frame-rate file lands on the wrong frame, and every `set()`
re-decodes from the keyframe. So frames are found by grabbing forward and
reading each frame's real timestamp; `set()` is only used to jump over whole
GOPs, and where it lands is checked. OpenCV reads bytes through the `BytesIO`
it was given without holding a reference: the capture keeps it alive here.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.base import VideoBackend, walk_frames
from vlmbatch.media.video.options import VideoOptions, cpu_decoder_threads
from vlmbatch.media.video.probe import StreamIndex
from vlmbatch.media.video.sampling import nearest_frame
from vlmbatch.media.refs import MediaSource


@contextmanager
def open_capture(source: MediaSource, raw_packets: bool = False) -> Iterator[Any]:
    """A `cv2.VideoCapture` on a path or on bytes, released on exit.

    `raw_packets` makes `grab()` only demux (no decoding): timestamps and
    keyframe flags of packets, for the probe.
    """
    import cv2

    buffer = io.BytesIO(source.data) if source.data is not None else None
    threads = cpu_decoder_threads()
    params = [cv2.CAP_PROP_FORMAT, -1] if raw_packets else ([cv2.CAP_PROP_N_THREADS, threads] if threads else [])
    capture = cv2.VideoCapture(source.path if buffer is None else buffer, cv2.CAP_FFMPEG, params)
    try:
        if not capture.isOpened():
            raise RowError(ErrorType.MEDIA_DECODE, f"cannot open video {source.name} (no video stream or not a video)")
        yield capture
    finally:
        capture.release()
        del buffer  # only now may the bytes the capture reads be freed


_MAX_GRAB_FAILURES = 8
_SEEK_MARGIN = 16  # OpenCV's seek to frame n starts at the keyframe before n - 16


class OpenCVBackend(VideoBackend):
    name = "opencv"

    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        import cv2

        with open_capture(source) as capture:
            fps = capture.get(cv2.CAP_PROP_FPS) or index.source_fps()

            def position() -> int:
                return nearest_frame(index.timestamps, capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0)

            def fetch() -> Any:
                ok, bgr = capture.retrieve()  # fails on a packet the decoder rejected
                return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB) if ok else None

            def frames_from(keyframe: int, target: int) -> Iterator[tuple[int, Any]]:
                if keyframe > 0:
                    landed = _seek_at_or_before(capture, target, index, fps, position)
                    if landed is None:
                        return
                    yield landed, fetch
                for _ in grab_loop(capture):
                    yield position(), fetch

            return walk_frames(wanted, index, frames_from, seek_margin=_SEEK_MARGIN)


def grab_loop(capture: Any) -> Iterator[None]:
    """`grab()` forward to the end, yielding after each grabbed frame.

    A damaged packet makes one `grab()` fail mid-stream while the next one
    succeeds, so only repeated failures mean the end.
    """
    failures = 0
    while failures < _MAX_GRAB_FAILURES:
        if capture.grab():
            failures = 0
            yield
        else:
            failures += 1


def _seek_at_or_before(capture: Any, target: int, index: StreamIndex, fps: float, position: Callable[[], int]) -> int | None:
    """Seek so that the grabbed frame is at or before frame `target`; its index, None at EOF.

    OpenCV seeks to the keyframe before `frame number - 16` and decodes forward to
    the frame number, so asking for the target itself decodes least. Its frame
    number is `pts * fps`, wrong on VFR files, so the landing is read back and the
    seek retried about a second earlier while it is past the target.
    """
    import cv2

    frame_number = round(index.timestamps[target] * fps)
    while True:
        capture.set(cv2.CAP_PROP_POS_FRAMES, frame_number)
        if not capture.grab():
            return None
        landed = position()
        if landed <= target or frame_number == 0:
            return landed
        frame_number = max(0, frame_number - max(1, int(fps)))
