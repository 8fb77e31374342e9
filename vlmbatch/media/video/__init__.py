"""Video loading: resolve the reference, index the stream, sample, decode, shrink.

`load_video(ref, options, ctx)` is the whole public surface; backends are picked
by `options.backend` (see `options.BACKENDS`) and imported only when used, so
missing optional decoders cost nothing until asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NamedTuple

from vlmbatch.config import MediaConfig
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.types import VideoFrames
from vlmbatch.media.video.base import VideoBackend
from vlmbatch.media.video.options import (
    VideoOptions,
    default_video_options,
    override_video_options,
    parse_video_options,
)
from vlmbatch.media.video.resize import resize_frames
from vlmbatch.media.video.sampling import QWEN2_5_VL, FrameConvention, plan_frames
from vlmbatch.media.fetch import FetchPolicy
from vlmbatch.media.refs import MediaContext, resolve_media

__all__ = [
    "FrameConvention",
    "QWEN2_5_VL",
    "VideoOptions",
    "default_video_options",
    "decodes_on_gpu",
    "ensure_backend_available",
    "get_backend",
    "load_video",
    "override_video_options",
    "parse_video_options",
    "prepare_video_backend",
]

class _BackendSpec(NamedTuple):
    module: str  # the vlmbatch module holding the backend class
    class_name: str
    library: str  # what it imports
    install_hint: str


_BACKENDS = {
    "opencv": _BackendSpec("opencv_backend", "OpenCVBackend", "cv2", "opencv-python-headless"),
    "pyav": _BackendSpec("pyav_backend", "PyAVBackend", "av", "av"),
    "torchcodec": _BackendSpec("torchcodec_backend", "TorchCodecBackend", "torchcodec", "torchcodec (and FFmpeg's shared libraries)"),
    "pynvvideocodec": _BackendSpec(
        "pynvvideocodec_backend", "PyNvVideoCodecBackend", "PyNvVideoCodec", "PyNvVideoCodec (and an NVIDIA GPU with libnvcuvid)"
    ),
    "deepstream": _BackendSpec(
        "deepstream_backend", "DeepStreamBackend", "nvidia.deepstream_videodecode",
        "nvidia-deepstream-videodecode-cu13 (driver >= 590, GStreamer)",
    ),
}
_instances: dict[str, VideoBackend] = {}
# Backends whose frames are CUDA tensors (they stay on the GPU into the vision encoder).
GPU_BACKENDS = frozenset({"pynvvideocodec", "deepstream"})


def decodes_on_gpu(video_kwargs: Any, media: MediaConfig) -> bool:
    """Whether a job's videos (its `media_io_kwargs["video"]` over the defaults of a process
    configured with `media`) come out of the decoder on the GPU; options that do not parse
    say False, the job's own checks report them."""
    try:
        return parse_video_options(video_kwargs, default_video_options(media)).backend in GPU_BACKENDS
    except ValueError:
        return False


def ensure_backend_available(name: str) -> None:
    """Fail at start-up (flags, env) rather than on every row when a decoder library is missing."""
    spec = _BACKENDS[name]
    try:
        found = importlib.util.find_spec(spec.library) is not None
    except ModuleNotFoundError:  # a missing parent package of a dotted name
        found = False
    if not found:
        raise ValueError(f"video backend {name!r} needs {spec.install_hint}, which is not installed")


def prepare_video_backend(options: VideoOptions) -> None:
    """Call at worker / server start-up with the process's options: a missing decoder
    library stops the command, and GPU decoder sessions are reserved with the start-up
    values (a request asking for another `hw_decoders` is then refused)."""
    ensure_backend_available(options.backend)
    get_backend(options.backend).reserve(options)


def get_backend(name: str) -> VideoBackend:
    """The process's one instance of backend `name` (GPU backends hold decoder pools)."""
    if name not in _instances:
        spec = _BACKENDS[name]
        module = importlib.import_module(f"vlmbatch.media.video.{spec.module}")
        _instances[name] = getattr(module, spec.class_name)()
    return _instances[name]


def load_video(
    ref: Any,
    options: VideoOptions | None = None,
    ctx: MediaContext | None = None,
    convention: FrameConvention = QWEN2_5_VL,
) -> VideoFrames:
    """Decode the frames the sampler picks from the video `ref` points to (`options` and
    `ctx` default to the built-in ones: a process's come from its `MediaLoader`).

    Raises `RowError`: MEDIA_NOT_FOUND / MEDIA_FORBIDDEN for bad paths, fetch
    errors for URLs, MEDIA_DECODE for files with no decodable video stream.
    """
    options = options or VideoOptions()
    source = resolve_media(ref, ctx or MediaContext(fetch=FetchPolicy.for_videos()), "video", "video")
    backend = get_backend(options.backend)
    index = backend.probe(source)
    plan = plan_frames(index.timestamps, options, convention)
    wanted = sorted(set(plan.indices))
    try:
        decoded = backend.decode(source, index, wanted, options)
    except RowError:
        raise
    except Exception as exc:  # a decoder library failing on one file must not end the job
        raise RowError(ErrorType.MEDIA_DECODE, f"{backend.name} failed on video {source.name}: {exc}") from exc
    frames = backend.stack([decoded[i] for i in plan.indices])
    frames = resize_frames(frames, options.max_pixels, options.max_side)
    return VideoFrames(
        frames=frames,
        timestamps=plan.timestamps,
        sampled_fps=plan.sampled_fps,
        source_fps=index.source_fps(),
        duration=plan.duration,
        frame_indices=plan.indices,
        backend=backend.name,
    )
