"""The GPU image path: which images it takes, that its tensors match the CPU path's, and its
per-image fallback. Runs on the CPU here (torchvision's CPU decoder stands in for nvJPEG);
the CUDA comparison runs where a GPU is present (and in `vlmbatch bench media`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.gpu_image import (
    GPU_MAX_ABS_DIFF,
    GPU_MEAN_ABS_DIFF,
    decode_jpegs,
    gpu_decodable,
    preprocess_images,
)
from vlmbatch.media.image import load_image
from vlmbatch.testing.data import (
    corrupt_image_bytes,
    encode_image,
    exif_rotated_jpeg,
    image_bytes,
    make_image,
    truncated_image_bytes,
)



@pytest.fixture(scope="module")
def processor() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)


def _jpeg(seed: int, size: tuple[int, int] = (96, 64)) -> bytes:
    return image_bytes(*size, seed=seed, fmt="JPEG")


def test_only_plain_jpegs_take_the_gpu_path() -> None:
    assert gpu_decodable(_jpeg(0))
    assert gpu_decodable(encode_image(make_image(32, 32, mode="L"), "JPEG"))
    assert not gpu_decodable(image_bytes(32, 32, fmt="PNG"))
    assert not gpu_decodable(exif_rotated_jpeg())  # nvJPEG would ignore the rotation
    assert not gpu_decodable(encode_image(make_image(32, 32).convert("CMYK"), "JPEG"))
    assert not gpu_decodable(corrupt_image_bytes())


def test_decoded_pixels_match_pillow_and_others_are_left_to_the_cpu() -> None:
    datas = [_jpeg(1), image_bytes(32, 32, fmt="PNG"), _jpeg(2, (50, 30))]
    decoded = decode_jpegs(datas, device="cpu")
    assert decoded[1] is None
    for data, image in ((datas[0], decoded[0]), (datas[2], decoded[2])):
        assert image is not None and image.dtype == torch.uint8
        assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(np.array(load_image(data))))


def test_a_jpeg_the_decoder_rejects_is_left_to_the_cpu() -> None:
    truncated = truncated_image_bytes("JPEG", keep=0.5)  # a valid header, half the scan data
    assert gpu_decodable(truncated)
    assert decode_jpegs([_jpeg(4), truncated], device="cpu")[1] is None


def test_processor_tensors_match_the_cpu_path_per_image(processor: Qwen2VLImageProcessor) -> None:
    datas = [_jpeg(5, (120, 80)), exif_rotated_jpeg(64, 32), corrupt_image_bytes(), _jpeg(6, (64, 64))]
    results = preprocess_images(datas, processor, device="cpu")
    assert isinstance(results[2], RowError) and results[2].error_type == ErrorType.MEDIA_DECODE
    for index in (0, 1, 3):
        expected = processor(images=[load_image(datas[index])], return_tensors="pt")
        got = results[index]
        assert not isinstance(got, RowError)
        assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
        assert torch.equal(got["pixel_values"], expected["pixel_values"])


@pytest.mark.gpu
def test_gpu_tensors_match_the_cpu_path_within_decoder_rounding(processor: Qwen2VLImageProcessor) -> None:
    datas = [_jpeg(seed, (640, 360)) for seed in range(8)]
    results = preprocess_images(datas, processor, device="cuda")
    for data, got in zip(datas, results):
        assert not isinstance(got, RowError) and got["pixel_values"].device.type == "cuda"
        expected = processor(images=[load_image(data)], return_tensors="pt")["pixel_values"]
        diff = (got["pixel_values"].cpu().float() - expected).abs()
        assert diff.max() <= GPU_MAX_ABS_DIFF and diff.mean() <= GPU_MEAN_ABS_DIFF
