"""Image references → RGB PIL images, with every bad input turned into a `RowError`.

A reference is a PIL image, raw bytes, a path, a `file://` URL, an http(s) URL, a
`data:image/...` URL, or the Hugging Face `Image` struct `{"bytes": ..., "path": ...}`.
The pixel limit is enforced from the header, before any pixel is decoded (PIL's
`Image.open` is lazy), so a decompression bomb costs a few bytes of reading.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from PIL import Image, ImageOps

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.refs import MediaContext, resolve_media

WHITE = (255, 255, 255, 255)
ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


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
    with opened_image(source, name, ctx, param) as image:
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
    source = resolve_media(ref, ctx, "image", param)
    return (Path(source.path) if source.path else io.BytesIO(source.data)), source.name


def _check_pixels(size: tuple[int, int], ctx: MediaContext, name: str, param: str) -> None:
    width, height = size
    if width * height > ctx.max_pixels:
        raise RowError(
            ErrorType.MEDIA_TOO_LARGE,
            f"image {name} is {width}x{height} ({width * height:,} pixels), over the {ctx.max_pixels:,}-pixel limit",
            param,
        )


@contextmanager
def opened_image(source: Path | BinaryIO, name: str, ctx: MediaContext, param: str) -> Iterator[Image.Image]:
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
    with opened_image(source, name, ctx, param) as image:
        image.load()  # a full decode, so truncated files fail here and not later
        return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    image = ImageOps.exif_transpose(image)
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        background = Image.new("RGBA", image.size, WHITE)
        background.alpha_composite(image.convert("RGBA"))
        return background.convert("RGB")
    return image.convert("RGB")
