"""JPEG decoding (nvJPEG), resizing and normalising on the GPU, with a per-image CPU fallback.

1080p JPEG decoding is ~10 ms of CPU per image; nvJPEG decodes a batch of them in a
fraction of that and leaves the pixels where the vision encoder needs them. Only JPEGs
that nvJPEG shows exactly as the CPU path would go this way (baseline/progressive RGB or
grayscale without an EXIF rotation, which nvJPEG ignores); everything else - PNG, CMYK,
rotated, corrupt - takes the CPU path (`load_image`), so per-image errors stay the CPU
path's `RowError`s. Resizing and normalising is the model's own (torch-backed) image
processor run with `device=`, so the GPU path produces the same tensors as the CPU path
up to JPEG decoders' IDCT rounding.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.image import MediaContext, load_image, opened_image
from vlmbatch.media.refs import resolve_media
from vlmbatch.media.types import EncodedImage

JPEG_MAGIC = b"\xff\xd8\xff"
# How far the GPU path's processor outputs may be from the CPU path's (normalised units,
# i.e. divided by CLIP's std ~0.27). nvJPEG and libjpeg-turbo round the IDCT differently by
# a level or two of 255 (~0.03 here), and upsample chroma differently, which at sharp colour
# edges reaches ~20 levels: measured on the H200 (2026-11-30, 1080p JPEGs): mean 0.0077,
# max 0.277. The mean is the meaningful bound; the max only guards against a wrong colour
# conversion or orientation, which would be off by far more.
GPU_MAX_ABS_DIFF = 0.35
GPU_MEAN_ABS_DIFF = 0.01
_EXIF_ORIENTATION = 0x0112


def gpu_decodable(data: bytes) -> bool:
    """True for JPEGs that nvJPEG decodes to the picture the CPU path shows (header read only)."""
    if not data.startswith(JPEG_MAGIC):
        return False
    try:
        with Image.open(io.BytesIO(data)) as image:
            return (
                image.format == "JPEG"
                and image.mode in ("RGB", "L")
                and image.getexif().get(_EXIF_ORIENTATION, 1) == 1
            )
    except (OSError, SyntaxError, ValueError):
        return False


def decode_jpegs(datas: Sequence[bytes], device: str | torch.device = "cuda") -> list[torch.Tensor | None]:
    """(3, H, W) uint8 RGB tensors on `device`, decoded in one batch; None where this path
    cannot decode (not a plain JPEG, or nvJPEG rejects it): those go to the CPU path."""
    from torchvision.io import ImageReadMode, decode_jpeg

    decodable = [i for i, data in enumerate(datas) if gpu_decodable(data)]
    encoded = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in decodable]
    decoded: list[torch.Tensor | None] = [None] * len(datas)
    if not encoded:
        return decoded
    try:
        batch = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one bad image fails the batch: decode one by one to find it
        batch = [_decode_one(data, device) for data in encoded]
    for index, image in zip(decodable, batch):
        decoded[index] = image
    return decoded


def _decode_one(encoded: torch.Tensor, device: str | torch.device) -> torch.Tensor | None:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


def cpu_image_tensor(data: bytes, ctx: MediaContext | None = None) -> torch.Tensor:
    """The CPU path for one image (EXIF, alpha, pixel limits, `RowError`s) as a (3, H, W) uint8 tensor."""
    import numpy as np

    return torch.from_numpy(np.array(load_image(data, ctx))).permute(2, 0, 1)


def preprocess_images(
    datas: Sequence[bytes],
    image_processor: Any,
    device: str | torch.device = "cuda",
    ctx: MediaContext | None = None,
) -> list[dict[str, torch.Tensor] | RowError]:
    """Encoded images → the image processor's tensors on `device`, one dict per image (or
    the `RowError` of an image neither path can load).

    Each dict is what the processor returns for that image alone (`pixel_values`, and
    `image_grid_thw` for Qwen): a media item's tensors.
    """
    images: list[torch.Tensor | RowError | None] = list(decode_jpegs(datas, device))
    for index, image in enumerate(images):
        if image is None:
            try:
                images[index] = cpu_image_tensor(datas[index], ctx).to(device)
            except RowError as error:
                images[index] = error
    loaded = [image for image in images if isinstance(image, torch.Tensor)]
    per_image = iter(_split_per_image(image_processor(images=loaded, return_tensors="pt", device=device)) if loaded else [])
    return [image if isinstance(image, RowError) else next(per_image) for image in images]


def _split_per_image(processed: Any) -> list[dict[str, torch.Tensor]]:
    """Cut a batched processor output into per-image dicts: Qwen packs every image's patches
    into one `pixel_values` (counts from `image_grid_thw`), CLIP-style processors stack them."""
    pixel_values = processed["pixel_values"]
    grids = processed.get("image_grid_thw")
    if grids is None:
        return [{"pixel_values": pixel_values[i : i + 1]} for i in range(len(pixel_values))]
    patches = pixel_values.split(grids.prod(dim=-1).tolist())
    return [{"pixel_values": p, "image_grid_thw": grids[i : i + 1]} for i, p in enumerate(patches)]


def load_encoded_or_image(ref: Any, ctx: MediaContext, param: str = "image") -> EncodedImage | Image.Image:
    """An `EncodedImage` for a GPU-decodable JPEG, else the CPU path's PIL image (from the
    same bytes, so a URL is fetched once). Both raise the CPU path's `RowError`s for bad files.

    A deferred JPEG is still validated cheaply: a 1/8-scale PIL draft decode parses all the
    entropy data, so corrupt and truncated files fail as this row's `media_decode_error`,
    while the IDCT and colour work (most of a decode's CPU time) is skipped.
    """
    source = resolve_media(ref, ctx, "image", param)
    try:
        data = source.data if source.data is not None else Path(source.path or "").read_bytes()
    except OSError as exc:
        raise RowError(ErrorType.MEDIA_NOT_FOUND, f"cannot read image {source.name}: {exc}", param) from exc
    if not gpu_decodable(data):
        return load_image(data, ctx, param)
    with opened_image(io.BytesIO(data), source.name, ctx, param) as image:
        width, height = image.size
        image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))
        image.load()
    return EncodedImage(data, width, height)
