"""Media references → where their encoded bytes are, under one set of rules.

Images and videos accept the same references (a path relative to the dataset's folder,
`file://`, http(s), `s3://` (object storage), `data:` URLs, raw bytes, the Hugging Face
`{bytes, path}` struct), so
the rules that keep a server safe (an allowed folder that `..` and symlinks cannot leave,
no local files at all, the fetch policy) are written once, here.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.fetch import FetchPolicy, fetch_bytes

DEFAULT_MAX_PIXELS = 64_000_000
# What a `data:` URL may declare for each kind of medium.
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs")
DATA_URL_TYPES = {"image": ("image/",), "video": ("video/", "application/octet-stream")}


@dataclass(frozen=True)
class MediaContext:
    """Where media may come from and how big they may be.

    Batch jobs set `base_dir` to the dataset's folder (relative paths resolve there)
    and allow any local path. The server sets `allow_local_files=False`, or an
    `allowed_local_path` folder that resolved paths (after `..` and symlinks) must stay
    inside, and a fetch policy with `allow_private=False`. `max_pixels` applies to images.
    """

    base_dir: str | Path | None = None
    allowed_local_path: str | Path | None = None
    allow_local_files: bool = True
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    max_pixels: int = DEFAULT_MAX_PIXELS
    # Reads `s3://` (object-storage) media: `objects(url, max_bytes) -> bytes`, raising
    # `RowError` (`io.storage.ObjectMedia`: its bucket allow-list and the size cap). None:
    # such URLs are refused (the server's default).
    objects: Callable[[str, int], bytes] | None = None


@dataclass(frozen=True)
class MediaSource:
    """Exactly one of `path` and `data` is set; `name` is what error messages show."""

    name: str
    path: str | None = None
    data: bytes | None = None


def resolve_media(ref: Any, ctx: MediaContext, kind: str, param: str) -> MediaSource:
    """Map `ref` to a checked local path or to bytes; `RowError` for missing, forbidden or
    malformed references. `kind` ("image" or "video") only shapes messages and `data:` types."""
    if isinstance(ref, os.PathLike):
        return _local(os.fspath(ref), ctx, kind, param)
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return _in_memory(bytes(ref), "<bytes>", kind, param)
    if isinstance(ref, Mapping):
        if ref.get("bytes"):
            if not isinstance(ref["bytes"], (bytes, bytearray, memoryview)):
                raise RowError(ErrorType.INVALID_ROW, f"{kind} struct's 'bytes' must be bytes, got {type(ref['bytes']).__name__}", param)
            return _in_memory(bytes(ref["bytes"]), str(ref.get("path") or "<bytes>"), kind, param)
        if ref.get("path"):
            return resolve_media(str(ref["path"]), ctx, kind, param)
        raise RowError(ErrorType.INVALID_ROW, f"{kind} struct has neither 'bytes' nor 'path'", param)
    if not isinstance(ref, str) or not ref.strip():
        raise RowError(ErrorType.INVALID_ROW, f"{kind} must be a path, URL or bytes, got {type(ref).__name__}", param)
    scheme = urlparse(ref).scheme.lower()
    if scheme in ("http", "https"):
        try:
            return _in_memory(fetch_bytes(ref, ctx.fetch), ref, kind, param)
        except RowError as error:
            raise RowError(error.error_type, error.message, param) from error
    if scheme == "data":
        return _in_memory(_data_url_bytes(ref, kind, param), "<data URL>", kind, param)
    if scheme == "file":
        return _local(unquote(urlparse(ref).path), ctx, kind, param)
    if scheme in OBJECT_SCHEMES:
        if ctx.objects is None:
            raise RowError(ErrorType.MEDIA_FORBIDDEN, f"{scheme}:// {kind} media are not allowed here", param)
        try:
            return _in_memory(ctx.objects(ref, ctx.fetch.max_bytes), ref, kind, param)
        except RowError as error:
            raise RowError(error.error_type, error.message, param) from error
    if "://" in ref:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"unsupported URL scheme {scheme!r} for {kind} media", param)
    return _local(ref, ctx, kind, param)


def _in_memory(data: bytes, name: str, kind: str, param: str) -> MediaSource:
    if not data:
        raise RowError(ErrorType.MEDIA_DECODE, f"{kind} {name} is empty (0 bytes)", param)
    return MediaSource(name=name, data=data)


def _local(text: str, ctx: MediaContext, kind: str, param: str) -> MediaSource:
    if not ctx.allow_local_files:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"local {kind} files are not allowed here", param)
    path = Path(text)
    if not path.is_absolute() and ctx.base_dir is not None:
        path = Path(ctx.base_dir) / path
    resolved = path.resolve()  # normalises `..` and follows symlinks before the containment check
    if ctx.allowed_local_path is not None and not resolved.is_relative_to(Path(ctx.allowed_local_path).resolve()):
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"{kind} path {text} is outside the allowed folder", param)
    if not resolved.is_file():
        raise RowError(ErrorType.MEDIA_NOT_FOUND, f"{kind} file not found: {text}", param)
    if resolved.stat().st_size == 0:
        raise RowError(ErrorType.MEDIA_DECODE, f"{kind} {text} is empty (0 bytes)", param)
    return MediaSource(name=text, path=str(resolved))


def _data_url_bytes(url: str, kind: str, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise RowError(ErrorType.MEDIA_DECODE, "malformed data: URL (no comma)", param)
    media_type = header[len("data:") :].split(";")[0].strip().lower() or "text/plain"
    if not media_type.startswith(DATA_URL_TYPES[kind]):
        raise RowError(ErrorType.MEDIA_DECODE, f"data: URL holds {media_type}, not {kind} media", param)
    if not header.lower().endswith(";base64"):
        return unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RowError(ErrorType.MEDIA_DECODE, f"data: URL is not valid base64 ({exc})", param) from exc
