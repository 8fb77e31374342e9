"""`media_io_kwargs["video"]`: parsing and validation of the video options.

Options arrive in layers: a process's defaults (its `MediaConfig`: the
`VLMBATCH_VIDEO_LOADER_BACKEND` / thread-count variables, under `vlmbatch worker`'s own
`--media-io-kwargs`), then a job's or server's flags (`--media-io-kwargs`, a job-level
mistake: `ValueError` at start-up), then per row or request an override (a row-level
mistake: `RowError(INVALID_ROW)`, the job goes on). All go through `parse_video_options`
so the rules live in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from vlmbatch.config import MediaConfig
from vlmbatch.errors import ErrorType, RowError

BACKENDS = ("opencv", "pyav", "torchcodec", "pynvvideocodec", "deepstream")

# Options that only make sense for one backend; naming them with another
# backend is an error rather than silently ignored.
BACKEND_OPTIONS = {
    "num_ffmpeg_threads": "torchcodec",
    "seek_mode": "torchcodec",
    "hw_decoders": "pynvvideocodec",
    "pool_size": "deepstream",
}
SEEK_MODES = ("exact", "approximate")
POOL_SIZE_RANGE = (1, 16)


def clamp_pool_size(value: int) -> int:
    low, high = POOL_SIZE_RANGE
    return max(low, min(high, value))


@dataclass(frozen=True)
class VideoOptions:
    """Which decoder to use and which frames to take from each video.

    `num_frames` and `fps` exclude each other: a request that sets one drops the
    other's default. With neither, the model family's convention decides (see
    `sampling.FrameConvention`). `max_frames` and `max_duration` cap both modes;
    `max_pixels` / `max_side` shrink frames after decoding, the same for every backend.
    """

    backend: str = "opencv"
    num_frames: int | None = None
    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    max_duration: float | None = None
    max_pixels: int | None = None
    max_side: int | None = None
    num_ffmpeg_threads: int = 0
    seek_mode: str = "exact"
    hw_decoders: int = 2
    pool_size: int = 8


_KNOWN = {f.name for f in fields(VideoOptions)}


def default_video_options(media: MediaConfig) -> VideoOptions:
    """A process's defaults, from its `MediaConfig`: the default backend and thread count,
    under its own `video_options` (a worker's `--media-io-kwargs`). A job's and a row's own
    options apply on top. Raises `ValueError` naming a bad option, as for flags."""
    base = VideoOptions(backend=media.video_loader_backend, pool_size=clamp_pool_size(media.media_loading_thread_count))
    if base.backend not in BACKENDS:
        raise ValueError(f"VLMBATCH_VIDEO_LOADER_BACKEND: {base.backend!r} is not one of {', '.join(BACKENDS)}")
    return parse_video_options(media.video_options, base)


_cpu_decoder_threads = 0


def set_cpu_decoder_threads(count: int) -> None:
    """Threads each CPU decoder (OpenCV, PyAV, torchcodec unless a request sets
    `num_ffmpeg_threads`) may use in this process; 0 = each library's default (about one per
    core). Preprocessing pool workers set 1: the pool is the parallelism, and a
    threaded decoder refills its pipeline after every seek (measured on 60 s 720p h264
    clips: 8-19% less CPU per request with one thread, BENCHMARKS.md)."""
    global _cpu_decoder_threads
    _cpu_decoder_threads = max(0, count)


def cpu_decoder_threads() -> int:
    return _cpu_decoder_threads


def parse_video_options(video_kwargs: Mapping[str, Any] | None, base: VideoOptions | None = None) -> VideoOptions:
    """Apply `video_kwargs` (the `"video"` entry of media_io_kwargs) on top of `base` (a
    process's `default_video_options`; without one, the built-in `VideoOptions()`).

    Raises `ValueError` naming the offending option (and, for a backend option,
    the backend it belongs to and the one in use).
    """
    base = base or VideoOptions()
    if not video_kwargs:
        return base
    if not isinstance(video_kwargs, Mapping):
        raise ValueError(f"media_io_kwargs 'video' must be an object, got {type(video_kwargs).__name__}")
    unknown = sorted(set(video_kwargs) - _KNOWN)
    if unknown:
        raise ValueError(f"unknown video option(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(_KNOWN))}")
    backend = video_kwargs.get("backend", base.backend)
    if backend not in BACKENDS:
        raise ValueError(f"video option 'backend': {backend!r} is not one of {', '.join(BACKENDS)}")
    for name in video_kwargs:
        owner = BACKEND_OPTIONS.get(name)
        if owner is not None and owner != backend:
            raise ValueError(f"video option {name!r} belongs to backend {owner!r}, not to {backend!r}")
    values = {name: _checked(name, value) for name, value in video_kwargs.items()}
    if "num_frames" in values and "fps" not in values:
        values["fps"] = None
    if "fps" in values and "num_frames" not in values:
        values["num_frames"] = None
    if values.get("num_frames") is not None and values.get("fps") is not None:
        raise ValueError("video options 'num_frames' and 'fps' exclude each other; give one")
    if "pool_size" in values:
        values["pool_size"] = clamp_pool_size(values["pool_size"])
    return replace(base, **values)


def override_video_options(base: VideoOptions, video_kwargs: Mapping[str, Any] | None, param: str = "media_io_kwargs") -> VideoOptions:
    """A row's or request's override: the same rules, reported as that row's error.

    `hw_decoders` is reserved at start-up, so an override may only repeat it.
    """
    try:
        options = parse_video_options(video_kwargs, base)
    except ValueError as exc:
        raise RowError(ErrorType.INVALID_ROW, str(exc), param) from exc
    if options.hw_decoders != base.hw_decoders:
        raise RowError(
            ErrorType.INVALID_ROW,
            f"video option 'hw_decoders' is fixed at start-up ({base.hw_decoders}); a request cannot change it",
            param,
        )
    return options


def _checked(name: str, value: Any) -> Any:
    """Type and range of one option value; `None` clears the optional ones."""
    if name == "backend":
        return value
    if name == "seek_mode":
        if value not in SEEK_MODES:
            raise ValueError(f"video option 'seek_mode' (torchcodec) must be one of {', '.join(SEEK_MODES)}, got {value!r}")
        return value
    optional = name in {"num_frames", "fps", "min_frames", "max_frames", "max_duration", "max_pixels", "max_side"}
    if value is None and optional:
        return None
    if name in {"fps", "max_duration"}:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"video option {name!r} must be a positive number, got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"video option {name!r} must be an integer, got {value!r}")
    minimum = 0 if name == "num_ffmpeg_threads" else 1
    if value < minimum and name != "pool_size":  # pool_size is clamped, not refused
        raise ValueError(f"video option {name!r} must be >= {minimum}, got {value!r}")
    return value
