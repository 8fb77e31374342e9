"""load_image: every kind of reference, normalisation, and every bad input as a typed RowError."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.fetch import FetchPolicy
from vlmbatch.media.image import MediaContext, content_hash, load_image
from vlmbatch.testing.data import (
    corrupt_image_bytes,
    data_url,
    decompression_bomb_png,
    encode_image,
    exif_rotated_jpeg,
    image_bytes,
    make_image,
    truncated_image_bytes,
)


def row_error(ref, ctx: MediaContext | None = None) -> RowError:
    with pytest.raises(RowError) as caught:
        load_image(ref, ctx, param="image[0]")
    assert caught.value.param == "image[0]"
    return caught.value


@pytest.fixture
def png_file(tmp_path: Path) -> Path:
    path = tmp_path / "pics" / "a.png"
    path.parent.mkdir()
    path.write_bytes(image_bytes(40, 30, seed=3))
    return path


def test_every_reference_kind_gives_the_same_rgb_image(png_file: Path) -> None:
    data = png_file.read_bytes()
    expected = content_hash(Image.open(png_file).convert("RGB"))
    refs = [
        data,
        bytearray(data),
        str(png_file),
        png_file,
        png_file.as_uri(),
        "pics/a.png",
        data_url(data),
        {"bytes": data, "path": "ignored.png"},
        {"bytes": None, "path": "pics/a.png"},
        Image.open(png_file),
    ]
    ctx = MediaContext(base_dir=png_file.parent.parent)
    for ref in refs:
        image = load_image(ref, ctx)
        assert image.mode == "RGB" and image.size == (40, 30)
        assert content_hash(image) == expected, type(ref)


def test_exif_orientation_is_applied() -> None:
    image = load_image(exif_rotated_jpeg(64, 32, orientation=6))
    assert image.size == (32, 64)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_on_white(mode: str) -> None:
    picture = Image.new("RGBA", (4, 2), (255, 0, 0, 255))
    picture.putpixel((0, 0), (0, 0, 255, 0))  # fully transparent
    if mode == "LA":
        picture = picture.convert("LA")
    elif mode == "P":
        picture = picture.convert("RGB").quantize(colors=4)
        picture.info["transparency"] = picture.getpixel((0, 0))
    image = load_image(encode_image(picture, "PNG"))
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((3, 1)) != (255, 255, 255)


@pytest.mark.parametrize(
    ("ref", "error_type"),
    [
        (corrupt_image_bytes(), ErrorType.MEDIA_DECODE),
        (truncated_image_bytes("PNG"), ErrorType.MEDIA_DECODE),
        (truncated_image_bytes("JPEG"), ErrorType.MEDIA_DECODE),
        (b"", ErrorType.MEDIA_DECODE),
        ("data:text/plain;base64,aGVsbG8=", ErrorType.MEDIA_DECODE),
        ("data:,hello", ErrorType.MEDIA_DECODE),
        ("data:image/png;base64,%%%not-base64", ErrorType.MEDIA_DECODE),
        (data_url(corrupt_image_bytes()), ErrorType.MEDIA_DECODE),
        ("no/such/file.png", ErrorType.MEDIA_NOT_FOUND),
        ("file:///no/such/file.png", ErrorType.MEDIA_NOT_FOUND),
        ({"bytes": None, "path": None}, ErrorType.INVALID_ROW),
        (42, ErrorType.INVALID_ROW),
        ("s3://bucket/key.png", ErrorType.MEDIA_FORBIDDEN),
    ],
)
def test_bad_inputs(ref, error_type: str) -> None:
    assert row_error(ref).error_type == error_type


def test_decompression_bombs_are_refused_before_decoding() -> None:
    bomb = decompression_bomb_png(12_000)  # 144 Mpx: over our 64 Mpx default, under PIL's own error threshold
    started = time.monotonic()
    error = row_error(bomb)
    assert error.error_type == ErrorType.MEDIA_TOO_LARGE and "12000x12000" in error.message
    assert time.monotonic() - started < 0.5  # refused from the header, nothing decoded
    # PIL's own guard (above 2x MAX_IMAGE_PIXELS) also maps to MEDIA_TOO_LARGE
    assert row_error(decompression_bomb_png(15_000), MediaContext(max_pixels=10**9)).error_type == ErrorType.MEDIA_TOO_LARGE
    small_limit = MediaContext(max_pixels=100)
    assert row_error(image_bytes(20, 20), small_limit).error_type == ErrorType.MEDIA_TOO_LARGE
    assert row_error(make_image(20, 20), small_limit).error_type == ErrorType.MEDIA_TOO_LARGE


def test_allowed_local_path_blocks_escapes(tmp_path: Path, png_file: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png_file.read_bytes())
    os.symlink(png_file, allowed / "link-out.png")
    ctx = MediaContext(base_dir=allowed, allowed_local_path=allowed)
    assert load_image("ok.png", ctx).size == (40, 30)
    for ref in ("../pics/a.png", str(png_file), png_file.as_uri(), "link-out.png", {"path": "../pics/a.png"}):
        assert row_error(ref, ctx).error_type == ErrorType.MEDIA_FORBIDDEN, ref
    assert row_error("absent.png", ctx).error_type == ErrorType.MEDIA_NOT_FOUND
    no_local = MediaContext(allow_local_files=False)
    assert row_error(str(png_file), no_local).error_type == ErrorType.MEDIA_FORBIDDEN


def test_http_images_and_fetch_failures(png_file: Path) -> None:
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(png_file.parent))
    handler.log_message = lambda *args: None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    silent = socket.socket()  # accepts connections, never answers: a hung server
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        ctx = MediaContext(fetch=FetchPolicy(timeout=0.5, retries=0))
        assert load_image(f"{base}/a.png", ctx).size == (40, 30)
        assert row_error(f"{base}/b.png", ctx).error_type == ErrorType.MEDIA_NOT_FOUND
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}/a.png"
        assert row_error(hung, ctx).error_type == ErrorType.MEDIA_TIMEOUT
        guarded = MediaContext(fetch=FetchPolicy(timeout=2, allow_private=False))
        assert row_error(f"{base}/a.png", guarded).error_type == ErrorType.MEDIA_FORBIDDEN
    finally:
        httpd.shutdown()
        httpd.server_close()
        silent.close()
    assert row_error(f"{base}/a.png", ctx).error_type == ErrorType.MEDIA_FETCH  # server gone: connection refused
