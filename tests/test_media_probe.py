"""`probe_image`: the dry run's header-level image check agrees with a full load."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.image import MediaContext, load_image, probe_image


def encoded(fmt: str, size: tuple[int, int] = (40, 20), orientation: int | None = None) -> bytes:
    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    Image.new("RGB", size, "red").save(buffer, format=fmt, exif=exif.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("orientation", [None, 3, 6, 8])
def test_probe_reports_the_upright_size_that_load_image_returns(fmt: str, orientation: int | None) -> None:
    data = encoded(fmt, orientation=orientation)
    size = probe_image(data)
    assert (size.width, size.height) == load_image(data).size


def test_probe_refuses_truncated_png_and_oversized_images() -> None:
    data = encoded("PNG", (128, 128))
    with pytest.raises(RowError) as truncated:
        probe_image(data[: len(data) // 2])
    assert truncated.value.error_type == ErrorType.MEDIA_DECODE
    with pytest.raises(RowError) as too_large:
        probe_image(data, MediaContext(max_pixels=100))
    assert too_large.value.error_type == ErrorType.MEDIA_TOO_LARGE
