"""Turn a row's video reference into something a decoder can open: a local path or bytes.

References: a path (relative ones against the job's base folder), a `file://`
URL, an http(s) URL (downloaded with the video fetch timeout), a `data:video/...`
URL, raw bytes, or the Hugging Face struct `{"bytes": ..., "path": ...}`.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from vlmbatch.errors import ErrorType, RowError


@dataclass(frozen=True)
class VideoSource:
    """Exactly one of `path` and `data` is set; `name` is what error messages show."""

    name: str
    path: str | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class VideoContext:
    """Where relative paths resolve, which local folder is allowed, how URLs are fetched.

    `allowed_local_path` None allows any local path (batch jobs read their own
    disk); the server sets it from `--allowed-local-media-path`, and without that
    flag sets `allow_local_files=False` (as `image.MediaContext` does). `fetch_policy`
    is a `vlmbatch.media.fetch.FetchPolicy` meant for videos (`FetchPolicy.for_videos(...)`:
    the video timeout and size cap); None uses `FetchPolicy.for_videos()`.
    """

    base_dir: str | None = None
    allowed_local_path: str | None = None
    fetch_policy: Any = None
    allow_local_files: bool = True


def resolve_video_source(ref: Any, ctx: VideoContext | None = None, param: str = "video") -> VideoSource:
    """Map `ref` to a `VideoSource`, raising `RowError` for missing, forbidden or malformed refs."""
    ctx = ctx or VideoContext()
    if isinstance(ref, os.PathLike):
        return _local(os.fspath(ref), ctx, param)
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(ref), "<bytes>", param)
    if isinstance(ref, Mapping):
        if ref.get("bytes"):
            return _from_bytes(bytes(ref["bytes"]), str(ref.get("path") or "<bytes>"), param)
        if ref.get("path"):
            return resolve_video_source(ref["path"], ctx, param)
        raise RowError(ErrorType.INVALID_ROW, "video struct has neither 'bytes' nor 'path'", param)
    if not isinstance(ref, str) or not ref:
        raise RowError(ErrorType.INVALID_ROW, f"video must be a path, URL or bytes, got {type(ref).__name__}", param)
    scheme = urlparse(ref).scheme.lower()
    if scheme in ("http", "https"):
        return _from_bytes(_fetch(ref, ctx), ref, param)
    if scheme == "data":
        return _from_bytes(_decode_data_url(ref, param), "<data URL>", param)
    if scheme == "file":
        return _local(unquote(urlparse(ref).path), ctx, param)
    if "://" in ref:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"unsupported URL scheme {scheme!r} for a video", param)
    return _local(ref, ctx, param)


def _from_bytes(data: bytes, name: str, param: str) -> VideoSource:
    if not data:
        raise RowError(ErrorType.MEDIA_DECODE, f"video {name} is empty (0 bytes)", param)
    return VideoSource(name=name, data=data)


def _local(path_text: str, ctx: VideoContext, param: str) -> VideoSource:
    if not ctx.allow_local_files:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, "local video files are not allowed here", param)
    path = Path(path_text)
    if not path.is_absolute() and ctx.base_dir:
        path = Path(ctx.base_dir) / path
    resolved = path.resolve()  # follows symlinks, so a link out of the allowed folder is caught
    if ctx.allowed_local_path is not None:
        allowed = Path(ctx.allowed_local_path).resolve()
        if not resolved.is_relative_to(allowed):
            raise RowError(ErrorType.MEDIA_FORBIDDEN, f"video path {path_text} is outside {allowed}", param)
    if not resolved.is_file():
        raise RowError(ErrorType.MEDIA_NOT_FOUND, f"video file not found: {path_text}", param)
    if os.path.getsize(resolved) == 0:
        raise RowError(ErrorType.MEDIA_DECODE, f"video {path_text} is empty (0 bytes)", param)
    return VideoSource(name=str(path_text), path=str(resolved))


def _decode_data_url(url: str, param: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.lower().endswith(";base64"):
        raise RowError(ErrorType.INVALID_ROW, "video data: URL must be base64-encoded", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RowError(ErrorType.INVALID_ROW, f"video data: URL is not valid base64: {exc}", param) from exc


def _fetch(url: str, ctx: VideoContext) -> bytes:
    from vlmbatch.media.fetch import FetchPolicy, fetch_bytes

    return fetch_bytes(url, ctx.fetch_policy or FetchPolicy.for_videos())
