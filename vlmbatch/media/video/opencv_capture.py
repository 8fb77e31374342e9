"""An OpenCV capture on a path or bytes, and its grab loop: shared by the OpenCV backend,
the stream probe (OpenCV's raw-packet mode, where PyAV is missing) and the rotation
reader of the GPU decoders.

OpenCV reads bytes through the `BytesIO` it was given without holding a reference: the
capture keeps it alive here (OpenCV segfaults if it is garbage-collected).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.refs import MediaSource
from vlmbatch.media.video.options import cpu_decoder_threads

_MAX_GRAB_FAILURES = 8


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
