"""Chat media parts → decoded images and sampled videos, under the server's safety rules.

The loaders (`vlmbatch.media`) fetch and decode for batch jobs and the server alike; this
module adds what only a server facing untrusted clients needs: URLs only (no bare paths),
`file://` only inside `--allowed-local-media-path`, the private-address guard and domain
list on every fetch, the size and pixel caps, the fetch timeouts, per-request options
limited to frame sampling, and a thread pool so slow downloads never block the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any
from urllib.parse import urlparse

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.image import load_image
from vlmbatch.media.loader import MediaLoader
from vlmbatch.media.refs import OBJECT_SCHEMES
from vlmbatch.media.video import QWEN2_5_VL, FrameConvention, load_video, override_video_options
from vlmbatch.server.settings import ServerSettings

# What a request may change for its own videos: how many frames, not which decoder or
# how many threads (those are the operator's, through --media-io-kwargs).
REQUEST_VIDEO_OPTIONS = frozenset({"num_frames", "fps", "min_frames", "max_frames", "max_duration"})
_PART_KINDS = {"image_url": "image", "video_url": "video"}


def media_part_params(messages: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Where each image and video part sits (`messages[0].content[1].image_url`), in the
    order `parse_chat_messages` returns their refs, so a media error can name its part."""
    params: dict[str, list[str]] = {"image": [], "video": []}
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = _PART_KINDS.get(part.get("type"))
            if kind is not None:
                params[kind].append(f"messages[{i}].content[{j}].{part['type']}")
    return params


class ServerMedia:
    """Loads one request's media in parallel; each failure is a `RowError` naming its part."""

    def __init__(self, settings: ServerSettings, convention: FrameConvention = QWEN2_5_VL):
        """Raises `ValueError` for bad `--media-io-kwargs` (the server must not start).
        `convention`: how the model family samples videos."""
        self._settings = settings
        self._convention = convention
        unknown = set(settings.media_io_kwargs) - {"video"}
        if unknown:
            raise ValueError(f"--media-io-kwargs: unknown media kind(s) {sorted(unknown)}; only 'video' takes options")
        local = settings.allowed_local_media_path
        self._media = MediaLoader(
            settings.media,
            media_io_kwargs=settings.media_io_kwargs,
            allowed_local_path=local,
            allow_local_files=local is not None,
            allow_private=settings.allow_private_media_urls,
            allowed_domains=settings.allowed_media_domains or None,
            allowed_networks=settings.allowed_media_networks,
            max_bytes=settings.max_media_bytes,
            max_pixels=settings.max_image_pixels,
            objects=settings.object_media,
        )
        self._pool = ThreadPoolExecutor(settings.media.media_loading_thread_count, thread_name_prefix="vlmbatch-media")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_url(self, ref: Any, param: str) -> None:
        """Only URLs reach the loaders: a bare path would read the server's own disk."""
        scheme = urlparse(ref).scheme.lower() if isinstance(ref, str) else ""
        if scheme in ("http", "https", "data"):
            return
        if scheme in OBJECT_SCHEMES:
            if self._settings.object_media is None:
                raise RowError(
                    ErrorType.MEDIA_FORBIDDEN,
                    f"{scheme}:// media URLs are disabled; the server must be started with --allowed-media-buckets BUCKET",
                    param,
                )
            return
        if scheme == "file":
            if self._settings.allowed_local_media_path is None:
                raise RowError(
                    ErrorType.MEDIA_FORBIDDEN,
                    "file:// URLs are disabled; the server must be started with --allowed-local-media-path DIR",
                    param,
                )
            return
        raise RowError(ErrorType.INVALID_ROW, "a media url must be an http(s)://, data:, file:// or s3:// URL", param)

    def _request_video_options(self, request_kwargs: dict[str, dict[str, Any]] | None):
        request_kwargs = request_kwargs or {}
        unknown = set(request_kwargs) - {"video"}
        if unknown:
            raise RowError(ErrorType.INVALID_ROW, f"unknown media kind(s) {sorted(unknown)}; only 'video' takes options", "media_io_kwargs")
        video_kwargs = request_kwargs.get("video") or {}
        refused = set(video_kwargs) - REQUEST_VIDEO_OPTIONS
        if refused:
            raise RowError(
                ErrorType.INVALID_ROW,
                f"a request may set only {', '.join(sorted(REQUEST_VIDEO_OPTIONS))} for videos, not {', '.join(sorted(refused))}",
                "media_io_kwargs.video",
            )
        return override_video_options(self._media.video_options, video_kwargs, "media_io_kwargs.video")

    async def load(
        self,
        image_refs: list[Any],
        video_refs: list[Any],
        part_params: dict[str, list[str]],
        request_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Decoded images and sampled videos, in prompt order; the first failing part (in
        prompt order) raises its `RowError` with `param` naming that part."""
        video_options = self._request_video_options(request_kwargs)
        jobs = []
        for kind, refs in (("image", image_refs), ("video", video_refs)):
            for ref, param in zip(refs, part_params[kind], strict=True):
                self._check_url(ref, param)
                if kind == "image":
                    jobs.append((param, partial(load_image, ref, self._media.image_context, param)))
                else:
                    jobs.append((param, partial(load_video, ref, video_options, self._media.video_context, self._convention)))
        if not jobs:
            return [], []
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(self._pool, job) for _, job in jobs), return_exceptions=True)
        for (param, _), result in zip(jobs, results):
            if isinstance(result, RowError):
                raise RowError(result.error_type, result.message, param) from result
            if isinstance(result, BaseException):
                raise result
        return results[: len(image_refs)], results[len(image_refs) :]
