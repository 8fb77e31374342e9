"""The interface every decoding backend implements, and the frame walk they share.

A backend gets the stream index and the sorted, distinct frame indices the
sampler chose, and returns those frames as RGB uint8 (H, W, 3) with the file's
display rotation applied. It never chooses frames itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video.options import VideoOptions
from vlmbatch.media.video.probe import StreamIndex, probe_stream
from vlmbatch.media.refs import MediaSource


class VideoBackend(ABC):
    name: ClassVar[str]

    def probe(self, source: MediaSource) -> StreamIndex:
        return probe_stream(source)

    def reserve(self, options: VideoOptions) -> Any:
        """Claim (once) and return per-process resources: GPU decoder sessions, pools; CPU backends need none."""
        return None

    @abstractmethod
    def decode(self, source: MediaSource, index: StreamIndex, wanted: Sequence[int], options: VideoOptions) -> dict[int, Any]:
        """Frames for each of `wanted` (sorted, distinct indices into `index`), keyed by index."""

    def stack(self, frames: list[Any]) -> Any:
        """(T, H, W, 3) from per-frame arrays; GPU backends override to stay on the device."""
        import numpy as np

        return np.stack(frames)


# A seek flushes the decoder (frames in flight in a threaded decoder are lost)
# and repositions the demuxer: not worth it to skip just a few frames.
MIN_FRAMES_SKIPPED_BY_SEEK = 8


def walk_frames(
    wanted: Sequence[int],
    index: StreamIndex,
    seek: Callable[[int, int], Iterable[tuple[int, Callable[[], Any]]]],
    seek_margin: int = 0,
) -> dict[int, Any]:
    """Collect `wanted` frames by decoding forward and seeking only past whole GOPs.

    `seek(keyframe, target)` starts (or restarts) decoding at or after that
    keyframe but not past `target`, and yields
    `(frame index, fetch)` in presentation order; `fetch()` converts the frame
    to RGB (None if it cannot), so only wanted frames pay for conversion. A
    target that decoding skipped or could not convert (damaged data) takes the
    next good frame; targets past the end take the last one.

    A seek happens only when it skips at least `MIN_FRAMES_SKIPPED_BY_SEEK`
    frames that decoding forward would have to go through, so no frame is
    decoded twice. `seek_margin`: the backend's seek
    starts at the keyframe before `target - seek_margin` (OpenCV: 16).
    """
    frames: dict[int, Any] = {}
    iterator: Iterator[tuple[int, Callable[[], Any]]] | None = None
    position, current = -1, None  # index and pixels of the last frame fetched
    for target in wanted:
        if position >= target and current is not None:  # decoding skipped over this target
            frames[target] = current
            continue
        keyframe = index.keyframe_before(max(0, target - seek_margin))
        if iterator is None or keyframe > position + MIN_FRAMES_SKIPPED_BY_SEEK:
            iterator = iter(seek(keyframe, target))
        current = None
        for position, fetch in iterator:
            if position >= target and (current := fetch()) is not None:  # None: undecodable, try the next
                break
        if current is None:
            break  # end of stream
        frames[target] = current
    return fill_missing(frames, wanted)


def fill_missing(frames: dict[int, Any], wanted: Sequence[int]) -> dict[int, Any]:
    """Give targets beyond the last decodable frame that frame; none at all is a row error."""
    if not frames:
        raise RowError(ErrorType.MEDIA_DECODE, "no frame of the video could be decoded")
    last = frames[max(frames)]
    return {target: frames.get(target, last) for target in wanted}
