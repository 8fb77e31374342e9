"""GPU backends: colour conversion and resource rules on the CPU; decoding where a GPU is.

The NVDEC colour fix is a pure tensor function, so its agreement with FFmpeg's
own conversion is proven here on the CPU, on NV12 planes FFmpeg produced.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.media.video import load_video, parse_video_options
from vlmbatch.media.video.gpu import ProcessResource, display_rotation, nv12_to_rgb, rotate_frame
from vlmbatch.media.video.pynvvideocodec_backend import stream_colour
from vlmbatch.media.refs import MediaSource
from vlmbatch.testing.videos import ffmpeg_available, make_video

CLIP_KINDS = ["h264_mp4", "bt709_mp4", "full_range_mp4", "rotated_mp4"]
# The lent GPU machine has no ffmpeg: there the clips come made (by `make_clips` below, on
# a machine with ffmpeg) from this folder.
PREMADE_CLIPS = os.environ.get("VLMBATCH_TEST_GPU_CLIPS")


def make_clips(directory: str | Path) -> dict[str, Path]:
    return {kind: make_video(directory, kind, width=320, height=240, seconds=1.0) for kind in CLIP_KINDS}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if PREMADE_CLIPS:
        return {kind: next(Path(PREMADE_CLIPS).glob(f"{kind}.*")) for kind in CLIP_KINDS}
    if not ffmpeg_available():
        pytest.skip("needs the ffmpeg command line to make test videos (or VLMBATCH_TEST_GPU_CLIPS)")
    return make_clips(tmp_path_factory.mktemp("gpu-videos"))


def first_frame_planes(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """FFmpeg's RGB of the first frame and the same frame as NV12 (what NVDEC outputs)."""
    av = pytest.importorskip("av")

    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24"), frame.reformat(format="nv12").to_ndarray()


@pytest.mark.parametrize(
    "kind, expected_colour", [("h264_mp4", ("bt601", False)), ("bt709_mp4", ("bt709", False)), ("full_range_mp4", ("bt601", True))]
)
def test_nv12_conversion_matches_ffmpeg(clips, kind, expected_colour):
    # Needs PyAV for the reference planes, and its colour tags: PyNvVideoCodec's demuxer (the
    # fallback) reported no range for the full-range clip on the H200 (docs/video.md).
    pytest.importorskip("av")
    source = MediaSource(name=kind, path=str(clips[kind]))
    assert stream_colour(source) == expected_colour
    rgb, nv12 = first_frame_planes(clips[kind])
    ours = nv12_to_rgb(torch.from_numpy(nv12), *expected_colour).numpy()
    assert np.abs(ours.astype(np.int16) - rgb).mean() <= 1.0


def test_bt709_on_an_untagged_stream_is_the_measured_nvdec_mismatch(clips):
    """The library's RGB differed by ~8.8/255: the same size as this matrix mix-up."""
    rgb, nv12 = first_frame_planes(clips["h264_mp4"])
    wrong = nv12_to_rgb(torch.from_numpy(nv12), "bt709", False).numpy()
    assert 6.0 < np.abs(wrong.astype(np.int16) - rgb).mean() < 12.0


def test_display_rotation_and_device_rotation(clips):
    assert display_rotation(MediaSource(name="r", path=str(clips["rotated_mp4"]))) == 90
    assert display_rotation(MediaSource(name="p", path=str(clips["h264_mp4"]))) == 0
    frame = torch.arange(2 * 3 * 3, dtype=torch.uint8).reshape(2, 3, 3)
    assert torch.equal(rotate_frame(frame, 90), torch.from_numpy(np.rot90(frame.numpy()).copy()))
    assert rotate_frame(frame, 0) is frame


def test_strict_resource_refuses_another_size():
    built: list[int] = []
    slots: ProcessResource[list[int]] = ProcessResource("hw_decoders", strict=True)
    first = slots.get(2, lambda n: built.append(n) or built)
    assert slots.get(2, lambda n: []) is first and built == [2]
    with pytest.raises(RowError) as caught:
        slots.get(3, lambda n: [])
    assert caught.value.error_type == ErrorType.INVALID_ROW and "'hw_decoders'=3" in caught.value.message


def test_deepstream_pool_first_size_wins():
    from vlmbatch.media.video.deepstream_backend import DECODE_POOL

    assert DECODE_POOL.strict is False and DECODE_POOL.option == "pool_size"
    pool: ProcessResource[str] = ProcessResource("pool_size", strict=False)
    sizes = [parse_video_options({"backend": "deepstream", "pool_size": n}).pool_size for n in (40, 3)]
    assert sizes == [16, 3]
    assert pool.get(sizes[0], lambda n: f"pool of {n}") == "pool of 16"
    assert pool.get(sizes[1], lambda n: f"pool of {n}") == "pool of 16"
    assert pool.size == 16


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="PyNvVideoCodec is not installed")
@pytest.mark.parametrize("kind", ["h264_mp4", "bt709_mp4", "rotated_mp4"])
def test_pynvvideocodec_matches_opencv(clips, kind):
    options = {"num_frames": 8}
    gpu = load_video(clips[kind], parse_video_options({"backend": "pynvvideocodec", **options}))
    cpu = load_video(clips[kind], parse_video_options({"backend": "opencv", **options}))
    assert gpu.frames.is_cuda
    assert gpu.frame_indices == cpu.frame_indices
    diff = np.abs(gpu.frames.cpu().numpy().astype(np.int16) - cpu.frames).mean(axis=(1, 2, 3))
    assert diff.max() <= 2.0, diff


@needs_cuda
@pytest.mark.skip(reason="DeepStream needs an NVIDIA driver >= 590 and GStreamer system packages; the lent H200 has driver 580 and no GStreamer")
def test_deepstream_matches_opencv(clips):
    gpu = load_video(clips["h264_mp4"], parse_video_options({"backend": "deepstream", "num_frames": 8}))
    cpu = load_video(clips["h264_mp4"], parse_video_options({"backend": "opencv", "num_frames": 8}))
    assert np.abs(gpu.frames.cpu().numpy().astype(np.int16) - cpu.frames).mean() <= 2.0
