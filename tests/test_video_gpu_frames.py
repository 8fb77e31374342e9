"""Frames as torch tensors go through the Qwen adapter as they are: on the CPU exactly the
numpy path's outputs, on the GPU `pixel_values_videos` on the GPU (no host round trip); and
jobs whose video backend decodes on the GPU prepare their rows in the engine process."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.readers import open_dataset
from vlmbatch.job import preparer, process_pool
from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer
from vlmbatch.media.types import VideoFrames
from vlmbatch.media.video import decodes_on_gpu, load_video, parse_video_options
from vlmbatch.families.registry import load_adapter
from vlmbatch.testing.data import write_image_dataset
from vlmbatch.testing.gpu_frames import VIDEO_PROMPT, compare_on_device, within_tolerance
from vlmbatch.testing.videos import ffmpeg_available, make_video

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def qwen(tiny_qwen: Path):
    return load_adapter(str(tiny_qwen))


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> VideoFrames:
    """Real decoded frames (a 320x240 clip the processor must resize), else random ones."""
    if not ffmpeg_available():
        frames = np.random.default_rng(0).integers(0, 256, (4, 240, 320, 3), dtype=np.uint8)
        return VideoFrames(frames=frames, timestamps=[0.0, 0.5, 1.0, 1.5], sampled_fps=2.0, source_fps=30.0, duration=2.0)
    path = make_video(tmp_path_factory.mktemp("frames"), "h264_mp4", width=320, height=240, seconds=2.0)
    return load_video(str(path), parse_video_options({"backend": "opencv", "num_frames": 4}))


def test_cpu_tensor_frames_give_exactly_the_numpy_outputs(qwen, video):
    assert isinstance(video.frames, np.ndarray)
    from_numpy = qwen.prepare(VIDEO_PROMPT, videos=[video])
    from_tensor = qwen.prepare(VIDEO_PROMPT, videos=[replace(video, frames=torch.from_numpy(video.frames))])
    assert from_tensor.prompt_token_ids == from_numpy.prompt_token_ids
    (ours,), (theirs,) = from_tensor.media, from_numpy.media
    assert ours.tensors.keys() == theirs.tensors.keys()
    for key, value in theirs.tensors.items():
        assert ours.tensors[key].device.type == "cpu"
        assert torch.equal(ours.tensors[key], value), key
    assert ours.content_hash == theirs.content_hash
    result = compare_on_device(qwen, video, "cpu")
    assert within_tolerance(result) and result["max_abs_diff"] == 0.0


@needs_cuda
def test_cuda_frames_give_pixel_values_on_cuda_equal_to_the_cpu_path(qwen, video):
    result = compare_on_device(qwen, video, "cuda")
    assert result["device"].startswith("cuda")
    assert within_tolerance(result), result


def test_gpu_backends_are_recognised_from_the_job_options():
    media = MediaConfig()
    assert decodes_on_gpu({"backend": "pynvvideocodec"}, media) and decodes_on_gpu({"backend": "deepstream"}, media)
    assert not decodes_on_gpu(None, media) and not decodes_on_gpu({"backend": "torchcodec"}, media)
    assert not decodes_on_gpu({"backend": "no-such-decoder"}, media)  # reported by the job's own checks
    gpu_default = MediaConfig.from_env({"VLMBATCH_VIDEO_LOADER_BACKEND": "pynvvideocodec"})
    assert decodes_on_gpu(None, gpu_default) and not decodes_on_gpu({"backend": "opencv"}, gpu_default)


def test_a_gpu_video_job_prepares_its_rows_in_this_process(
    tmp_path: Path, tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch
):
    """No pool even though workers are asked for: its processes would each open a CUDA context."""

    def no_pool(*args, **kwargs):
        raise AssertionError("a GPU-video job must not start preprocessing processes")

    monkeypatch.setattr(preparer, "ProcessPool", no_pool)
    dataset = write_image_dataset(tmp_path / "rows.jsonl", 4, image_mode="data_url", image_format="JPEG")
    reader = open_dataset(dataset)
    manifest = Manifest.for_dataset(reader, output_dir=tmp_path / "out", model=str(tiny_qwen), engine="hf",
                                    sampling={"max_tokens": 4}, shard_size=100,
                                    media_io_kwargs={"video": {"backend": "pynvvideocodec"}})  # fmt: skip
    rows = [row for batch in reader.iter_rows() for row in batch]
    preparation = RowPreparation.for_job(manifest, AdapterSpec(str(tiny_qwen)), SamplingParams(max_tokens=4), MediaConfig())
    with RowPreparer(WorkerConfig(preprocess_workers=2), MediaConfig()) as two_workers:
        got = list(two_workers.prepare(rows, preparation))
    assert [item.row_id for item in got] == [0, 1, 2, 3]
    assert all(item.prepared is not None for item in got)


@needs_cuda
def test_cuda_tensors_cross_the_pool_pipe_through_the_host():
    """A row that overrides the backend to a GPU one inside a pool worker: its tensors arrive on the CPU."""
    pixels = torch.randn(5, 7, device="cuda").to(torch.bfloat16)
    received = pickle.loads(process_pool._dumps({"pixel_values_videos": pixels}))["pixel_values_videos"]
    assert received.device.type == "cpu" and torch.equal(received, pixels.cpu())
