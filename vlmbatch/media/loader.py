"""One place that turns media settings (a process's `MediaConfig`, a job's flags, per-row
overrides) into loaded media.

Batch jobs, `LLM.chat` and the server differ only in their settings (where relative
paths resolve, which local folder and which hosts are allowed), so they all load
images and videos through a `MediaLoader` configured for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmbatch.config import MediaConfig
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.fetch import FetchPolicy
from vlmbatch.media.image import ImageSize, load_image, probe_image
from vlmbatch.media.refs import DEFAULT_MAX_PIXELS, MediaContext
from vlmbatch.media.types import VideoFrames
from vlmbatch.media.video.sampling import QWEN2_5_VL, FrameConvention

IMAGE_OPTIONS = {"max_pixels"}


class MediaLoader:
    """Loads images and videos under one set of rules.

    `config` is the process's (fetch timeouts, default video decoder and threads, a
    worker's own video options); `media_io_kwargs` is `{"image": {...}, "video": {...}}`
    as given by a job's or server's `--media-io-kwargs`, on top of it. It is validated
    once here (job-level), while a row's or request's own `media_io_kwargs` becomes a
    `RowError` when wrong.
    """

    def __init__(
        self,
        config: MediaConfig,
        base_dir: str | Path | None = None,
        media_io_kwargs: dict[str, Any] | None = None,
        *,
        allowed_local_path: str | Path | None = None,
        allow_local_files: bool = True,
        allow_private: bool = True,
        allowed_domains: tuple[str, ...] | None = None,
        allowed_networks: tuple[str, ...] = (),
        max_bytes: int | None = None,
        max_pixels: int | None = None,
        objects: Any = None,
    ):
        from vlmbatch.media.video import default_video_options, parse_video_options

        media_io_kwargs = media_io_kwargs or {}
        image_options = dict(media_io_kwargs.get("image") or {})
        unknown = set(image_options) - IMAGE_OPTIONS
        if unknown:
            raise ValueError(f"unknown image option(s) {sorted(unknown)}; known: {sorted(IMAGE_OPTIONS)}")
        fetch: dict[str, Any] = {"allow_private": allow_private, "allowed_domains": allowed_domains}
        fetch["allowed_networks"] = allowed_networks
        if max_bytes is not None:  # otherwise each kind keeps its own default cap
            fetch["max_bytes"] = max_bytes
        self.image_context = MediaContext(
            base_dir=base_dir,
            allowed_local_path=allowed_local_path,
            allow_local_files=allow_local_files,
            fetch=FetchPolicy.for_images(config, **fetch),
            max_pixels=max_pixels or int(image_options.get("max_pixels", DEFAULT_MAX_PIXELS)),
            objects=objects,
        )
        self.video_options = parse_video_options(media_io_kwargs.get("video"), default_video_options(config))
        self.video_context = MediaContext(
            base_dir=base_dir,
            allowed_local_path=allowed_local_path,
            allow_local_files=allow_local_files,
            fetch=FetchPolicy.for_videos(config, **fetch),
            objects=objects,
        )

    def image(self, ref: Any, param: str = "image") -> Any:
        return load_image(ref, self.image_context, param)

    def image_size(self, ref: Any, param: str = "image") -> ImageSize:
        """Header-level check for dry runs (see `probe_image`)."""
        return probe_image(ref, self.image_context, param)

    def video(self, ref: Any, param: str = "video", overrides: dict[str, Any] | None = None,
              convention: FrameConvention = QWEN2_5_VL) -> VideoFrames:
        """The frames of `ref` that the sampler picks under the model family's `convention`."""
        from vlmbatch.media.video import load_video, override_video_options

        options = self.video_options
        if overrides:
            unknown = set(overrides) - {"image", "video"}
            if unknown:
                raise RowError(ErrorType.INVALID_ROW, f"unknown media kind(s) {sorted(unknown)} in media_io_kwargs", "media_io_kwargs")
            options = override_video_options(options, overrides.get("video"))
        try:
            return load_video(ref, options, self.video_context, convention)
        except RowError as error:
            error.param = error.param or param
            raise
