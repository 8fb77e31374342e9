"""OpenCV (its bundled FFmpeg): the default backend, a grab loop with keyframe seeks.

Traps avoided: `CAP_PROP_POS_FRAMES` counts frames as `pts * average fps`, so a
seek on a variable-frame-rate file lands on the wrong frame, and every `set()`
re-decodes from the keyframe. So frames are found by grabbing forward and
reading each frame's real timestamp; `set()` is only used to jump over whole
GOPs, and where it lands is checked (the capture itself: `opencv_capture.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vlmbatch.media.video.base import VideoBackend, walk_frames
from vlmbatch.media.video.opencv_capture import grab_loop, open_capture
from vlmbatch.media.video.options import VideoOptions
from vlmbatch.media.video.probe import StreamIndex
from vlmbatch.media.video.sampling import nearest_frame
from vlmbatch.media.refs import MediaSource

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


def _seek_at_or_before(capture: Any, target: int, index: StreamIndex, fps: float, position: Callable[[], int]) -> int | None:
    """Seek so that the grabbed frame is at or before frame `target`; its index, None at EOF.

    OpenCV seeks to the keyframe before `frame number - 16` and decodes forward to
    the frame number, so asking for the target itself decodes least. Its frame
    number is `pts * fps`, wrong on VFR files, so the landing is read back and the
    seek retried about a second earlier while it is past the target, or past the
    last frame OpenCV counts (nothing to grab there: on a VFR file the last frames'
    numbers can exceed the frame count).
    """
    import cv2

    frame_number = round(index.timestamps[target] * fps)
    while True:
        capture.set(cv2.CAP_PROP_POS_FRAMES, frame_number)
        landed = position() if capture.grab() else None
        if (landed is not None and landed <= target) or frame_number == 0:
            return landed
        frame_number = max(0, frame_number - max(1, int(fps)))
