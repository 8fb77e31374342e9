"""Image references → RGB PIL images, with every bad input turned into a `RowError`.

A reference is a PIL image, raw bytes, a path, a `file://` URL, an http(s) URL, a
`data:image/...` URL, or the Hugging Face `Image` struct `{"bytes": ..., "path": ...}`.
The pixel limit is enforced from the header, before any pixel is decoded (PIL's
`Image.open` is lazy), so a decompression bomb costs a few bytes of reading.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, unquote_to_bytes, urlparse

from PIL import Image, ImageOps

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.fetch import FetchPolicy, fetch_bytes

DEFAULT_MAX_PIXELS = 64_000_000
WHITE = (255, 255, 255, 255)
ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


@dataclass(frozen=True)
class MediaContext:
    """Where an image may come from and how big it may be.

    Batch jobs set `base_dir` to the dataset's folder (relative paths resolve there)
    and allow any local path. The server sets `allow_local_files=False`, or an
    `allowed_local_path` folder that resolved paths (after `..` and symlinks) must stay
    inside, and a fetch policy with `allow_private=False`.
    """

    base_dir: str | Path | None = None
    allowed_local_path: str | Path | None = None
    allow_local_files: bool = True
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    max_pixels: int = DEFAULT_MAX_PIXELS


def load_image(ref: Any, ctx: MediaContext | None = None, param: str = "image") -> Image.Image:
    """Load, check and normalise one image: EXIF orientation applied, alpha on white, RGB."""
    ctx = ctx or MediaContext()
    if isinstance(ref, Image.Image):
        _check_pixels(ref.size, ctx, "<PIL image>", param)
        return _to_rgb(ref)
    source, name = _open_source(ref, ctx, param)
    return _decode(source, name, ctx, param)


@dataclass(frozen=True)
class ImageSize:
    """What a dry run needs of an image: its upright size (adapters read `.width`/`.height`)."""

    width: int
    height: int


# EXIF orientations 5-8 rotate by 90 degrees: the upright image has width and height swapped.
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def probe_image(ref: Any, ctx: MediaContext | None = None, param: str = "image") -> ImageSize:
    """Check an image without decoding its pixels: header, pixel limit, and PIL's `verify()`
    (chunk checksums for PNG), for `submit --dry-run`. Cheaper than `load_image` by an order
    of magnitude; damage that only a full decode finds still fails its row at run time."""
    ctx = ctx or MediaContext()
    if isinstance(ref, Image.Image):
        _check_pixels(ref.size, ctx, "<PIL image>", param)
        return ImageSize(*ref.size)
    source, name = _open_source(ref, ctx, param)
    with _opened(source, name, ctx, param) as image:
        width, height = image.size
        image.verify()  # must come straight after open; it also reads a PNG's trailing eXIf chunk
        if _exif_orientation(image) in _TRANSPOSING_ORIENTATIONS:
            width, height = height, width
        return ImageSize(width, height)


def _exif_orientation(image: Image.Image) -> int | None:
    raw = image.info.get("exif")
    if not raw:
        return None
    exif = Image.Exif()
    exif.load(raw)
    return exif.get(0x0112)


def content_hash(image: Image.Image) -> str:
    """A digest of the decoded pixels (same picture from any source → same key for caches)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _open_source(ref: Any, ctx: MediaContext, param: str) -> tuple[Path | BinaryIO, str]:
    """Where the encoded bytes are: a checked local path or an in-memory buffer."""
    if isinstance(ref, os.PathLike):
        return _local_path(os.fspath(ref), ctx, param), os.fspath(ref)
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(ref)), "<bytes>"
    if isinstance(ref, Mapping):
        if ref.get("bytes"):
            return io.BytesIO(bytes(ref["bytes"])), str(ref.get("path") or "<bytes>")
        if ref.get("path"):
            return _open_source(str(ref["path"]), ctx, param)
        raise RowError(ErrorType.INVALID_ROW, "image struct has neither 'bytes' nor 'path'", param)
    if not isinstance(ref, str) or not ref.strip():
        raise RowError(ErrorType.INVALID_ROW, f"image must be a path, URL or bytes, got {type(ref).__name__}", param)
    scheme = urlparse(ref).scheme.lower()
    if scheme in ("http", "https"):
        try:
            return io.BytesIO(fetch_bytes(ref, ctx.fetch)), ref
        except RowError as error:
            raise RowError(error.error_type, error.message, param) from error
    if scheme == "data":
        return io.BytesIO(_data_url_bytes(ref, param)), "<data URL>"
    if scheme == "file":
        return _local_path(unquote(urlparse(ref).path), ctx, param), ref
    if "://" in ref:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"unsupported URL scheme {scheme!r} for an image", param)
    return _local_path(ref, ctx, param), ref


def _local_path(text: str, ctx: MediaContext, param: str) -> Path:
    if not ctx.allow_local_files:
        raise RowError(ErrorType.MEDIA_FORBIDDEN, "local image files are not allowed here", param)
    path = Path(text)
    if not path.is_absolute() and ctx.base_dir is not None:
        path = Path(ctx.base_dir) / path
    resolved = path.resolve()  # normalises `..` and follows symlinks before the containment check
    if ctx.allowed_local_path is not None and not resolved.is_relative_to(Path(ctx.allowed_local_path).resolve()):
        raise RowError(ErrorType.MEDIA_FORBIDDEN, f"image path {text} is outside the allowed folder", param)
    if not resolved.is_file():
        raise RowError(ErrorType.MEDIA_NOT_FOUND, f"image file not found: {text}", param)
    return resolved


def _data_url_bytes(url: str, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise RowError(ErrorType.MEDIA_DECODE, "malformed data: URL (no comma)", param)
    media_type = header[len("data:") :].split(";")[0].strip().lower() or "text/plain"
    if not media_type.startswith("image/"):
        raise RowError(ErrorType.MEDIA_DECODE, f"data: URL holds {media_type}, not an image", param)
    if not header.lower().endswith(";base64"):
        return unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RowError(ErrorType.MEDIA_DECODE, f"data: URL is not valid base64 ({exc})", param) from exc


def _check_pixels(size: tuple[int, int], ctx: MediaContext, name: str, param: str) -> None:
    width, height = size
    if width * height > ctx.max_pixels:
        raise RowError(
            ErrorType.MEDIA_TOO_LARGE,
            f"image {name} is {width}x{height} ({width * height:,} pixels), over the {ctx.max_pixels:,}-pixel limit",
            param,
        )


@contextmanager
def _opened(source: Path | BinaryIO, name: str, ctx: MediaContext, param: str) -> Iterator[Image.Image]:
    """Open an image with its size checked against the pixel limit before any decoding;
    every PIL failure inside the block becomes that row's MEDIA_DECODE / MEDIA_TOO_LARGE."""
    try:
        with warnings.catch_warnings():
            # Our own limit (checked next) decides; PIL's warning threshold is arbitrary here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as image:
                _check_pixels(image.size, ctx, name, param)
                yield image
    except RowError:
        raise
    except Image.DecompressionBombError as exc:
        raise RowError(ErrorType.MEDIA_TOO_LARGE, f"image {name} is too large to decode safely: {exc}", param) from exc
    except Exception as exc:  # PIL raises many types for malformed files (OSError, SyntaxError, ValueError, ...)
        raise RowError(ErrorType.MEDIA_DECODE, f"cannot decode image {name}: {exc}", param) from exc


def _decode(source: Path | BinaryIO, name: str, ctx: MediaContext, param: str) -> Image.Image:
    with _opened(source, name, ctx, param) as image:
        image.load()  # a full decode, so truncated files fail here and not later
        return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    image = ImageOps.exif_transpose(image)
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        background = Image.new("RGBA", image.size, WHITE)
        background.alpha_composite(image.convert("RGBA"))
        return background.convert("RGB")
    return image.convert("RGB")
