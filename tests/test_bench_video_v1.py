"""`vlmbatch bench video-v1` (V1): its clips, what each engine is given (the same frames, the
same prompt token ids, no reuse of repeated clips), the vLLM child's lazy video prompts, and
a CPU smoke run of the whole thing on the tiny Qwen3-VL through the real job path, with
`generate()` run and vLLM reported as skipped."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vlmbatch.bench.peers.vllm import VideoPrompts, video_llm_kwargs, video_run_summary
from vlmbatch.bench.video_v1 import (
    V1Options,
    clip_info,
    find_clips,
    make_clips,
    plan_clips,
    request_clips,
    run,
    vllm_loader_fps,
    vllm_loader_indices,
    vllm_processor_kwargs,
    vllm_video_problems,
    vllm_video_spec,
)
from vlmbatch.media.video.options import parse_video_options
from vlmbatch.media.video.sampling import plan_frames
from vlmbatch.testing.videos import ffmpeg_available

needs_ffmpeg = pytest.mark.skipif(not ffmpeg_available(), reason="needs the ffmpeg command line")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Two distinct 2 s 160x120 h264 clips at 15 fps (30 frames: 16 of them sampled)."""
    if not ffmpeg_available():
        pytest.skip("needs the ffmpeg command line")
    folder = tmp_path_factory.mktemp("v1-clips")
    make_clips(folder, count=2, seconds=2, size="160x120", fps=15, echo=lambda _: None)
    return folder


@needs_ffmpeg
def test_make_clips_writes_distinct_h264_clips_and_their_manifest(clips):
    paths = find_clips(clips)
    manifest = json.loads((clips / "clips.json").read_text())
    assert [p.name for p in paths] == [c["file"] for c in manifest["clips"]] and len(paths) == 2
    assert manifest["crf"] == 32 and manifest["size"] == "160x120" and manifest["fps"] == 15
    infos = [clip_info(p) for p in paths]
    assert all((i["width"], i["height"], i["fps"], i["frames"], i["codec"]) == (160, 120, 15.0, 30, "h264") for i in infos)
    import cv2

    first = [cv2.VideoCapture(str(p)).read()[1] for p in paths]
    assert np.abs(first[0].astype(int) - first[1]).mean() > 10  # hue-rotated: no two clips share their pixels
    assert make_clips(clips, count=2, seconds=2, size="160x120", fps=15, echo=lambda _: None) == paths  # kept, not remade


@pytest.mark.parametrize(("total", "fps"), [(1800, 30.0), (1798, 30000 / 1001), (1500, 25.0), (30, 15.0)])
def test_vllm_qwen3_loader_rule_takes_the_frames_our_sampler_takes(total, fps):
    """vLLM 0.26's `qwen3_vl` loader takes round(linspace(0, total - 1, n)) for the n its
    fps gives; ours, the frames nearest to n instants evenly spread over the timestamps.
    With 16 frames no rounding tie can occur (the steps are (total - 1) / 15)."""
    info = {"frames": total, "fps": fps}
    ours = plan_frames([i / fps for i in range(total)], parse_video_options({"num_frames": 16})).indices
    assert vllm_loader_indices(info, vllm_loader_fps(info, 16)) == ours
    assert ours[0] == 0 and ours[-1] == total - 1 and len(ours) == 16


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    from vlmbatch.families.registry import load_adapter

    return load_adapter(str(tiny_model_dir("qwen3_vl")))


@needs_ffmpeg
def test_the_vllm_spec_carries_our_frames_prompts_and_no_reuse(adapter, clips, tmp_path):
    from vlmbatch.config import MediaConfig

    plans = plan_clips(adapter, find_clips(clips), 16, MediaConfig())
    spec = vllm_video_spec(tmp_path, plans, adapter, request_clips(3, 2), request_clips(5, 2), V1Options(), 8192)
    assert spec["timed"] == [0, 1, 0, 1, 0] and spec["warmup"] == [0, 1, 0] and spec["num_frames"] == 16
    assert spec["video_processor"] == "Qwen3VLVideoProcessor" and spec["video_token_id"] == adapter.video_token_id
    raw = spec["prompt_token_ids"]
    assert raw.count(adapter.video_token_id) == 1  # one placeholder: vLLM expands it itself
    for clip, plan in zip(spec["clips"], plans):
        assert clip["frame_indices"] == plan.frame_indices == plan.vllm_frame_indices
        assert clip["prompt_token_ids"].count(adapter.video_token_id) == plan.video_tokens > 0
        assert len(clip["prompt_token_ids"]) == plan.prompt_tokens > len(raw)  # timestamps and markers expanded
    assert spec["mm_processor_kwargs"] == vllm_processor_kwargs(adapter)
    kwargs = video_llm_kwargs(spec)
    assert kwargs["enable_prefix_caching"] is False and kwargs["mm_processor_cache_gb"] == 0
    assert kwargs["limit_mm_per_prompt"] == {"image": 0, "video": 1} and kwargs["load_format"] == "dummy"


def test_our_adapter_and_vllm_are_asked_for_the_same_per_frame_cap(adapter):
    video_processor = adapter.processor.video_processor
    if not hasattr(video_processor, "cap_pixels_per_frame"):
        assert vllm_processor_kwargs(adapter) == {}
    else:  # the adapter turns "unset" into the reference behaviour; vLLM's processor is told the same
        expected = True if video_processor.cap_pixels_per_frame is None else bool(video_processor.cap_pixels_per_frame)
        assert vllm_processor_kwargs(adapter) == {"cap_pixels_per_frame": expected}


def _spec() -> dict:
    """Two clips whose frames are [0, 5, 9] and expanded prompts [1, 7, 7, k] (7: the video token)."""
    clips = [{"path": f"clip{k}.mp4", "fps": 0.275, "frame_indices": [0, 5, 9], "prompt_token_ids": [1, 7, 7, k]} for k in (0, 1)]
    return {"clips": clips, "video_token_id": 7, "output_tokens": 4, "prompt_token_ids": [1, 7, 2]}


@pytest.mark.parametrize("threads", [0, 2])
def test_video_prompts_load_each_clip_as_it_is_taken_and_record_the_frames(threads):
    spec, loaded = _spec(), []

    def load(clip):
        loaded.append(clip["path"])
        return np.zeros((3, 2, 2, 3), np.uint8), {"frames_indices": [0, 5, 9], "fps": 30.0}

    prompts = VideoPrompts(spec["prompt_token_ids"], spec["clips"], [0, 1, 0], load, threads, window=2)
    assert len(prompts) == 3 and loaded == []  # nothing is decoded before vLLM takes the first prompt
    taken = list(prompts)
    prompts.close()
    assert [p["prompt_token_ids"] for p in taken] == [[1, 7, 2]] * 3
    assert all(p["multi_modal_data"]["video"][1]["frames_indices"] == [0, 5, 9] for p in taken)
    assert sorted(loaded) == ["clip0.mp4", "clip0.mp4", "clip1.mp4"] and all(s is not None for s in prompts.load_s)
    assert prompts.frame_indices == [[0, 5, 9]] * 3
    with pytest.raises(IndexError):
        prompts[3]


def test_a_vllm_video_run_is_checked_against_our_prompts_frames_and_lengths():
    spec = _spec()
    predecoded = {0: ("f0", {"frames_indices": [0, 5, 9]}), 1: ("f1", {"frames_indices": [0, 5, 8]})}
    prompts = VideoPrompts(spec["prompt_token_ids"], spec["clips"], [0, 1], None, predecoded=predecoded)
    list(prompts)
    outputs = [SimpleNamespace(prompt_token_ids=[1, 7, 7, 0], outputs=[SimpleNamespace(token_ids=[3] * 4)], num_cached_tokens=0),
               SimpleNamespace(prompt_token_ids=[1, 7, 7, 7, 1], outputs=[SimpleNamespace(token_ids=[3] * 2)], num_cached_tokens=5)]
    summary = video_run_summary(spec, [0, 1], outputs, prompts)
    assert summary["prompts_identical_to_ours"] == 1 and summary["frames_identical_to_ours"] == 1
    assert summary["video_tokens"] == [2, 3] and summary["prompt_tokens"] == [4, 5] and not summary["lengths_as_forced"]
    problems = vllm_video_problems(dict(summary, mode="files", seconds=1.0))
    assert len(problems) == 4 and "1 prompts differ" in problems[0] and "other frames for 1" in problems[1]
    assert "5 prompt tokens came from its prefix cache" in problems[3]
    first = VideoPrompts(spec["prompt_token_ids"], spec["clips"], [0], None, predecoded=predecoded)
    list(first)
    assert vllm_video_problems(dict(video_run_summary(spec, [0], outputs[:1], first), mode="files")) == []


@needs_ffmpeg
def test_v1_smoke_through_the_job_path_with_generate_and_vllm_skipped_on_the_cpu(clips, tmp_path):
    """4 rows of the tiny Qwen3-VL through `run_job_locally` (reader, pool, engine, result
    Parquet) after a 2-row warm-up; `generate()` at batch 2; vLLM skipped with why."""
    import pyarrow.parquet as pq

    from vlmbatch.config import MediaConfig, WorkerConfig

    out = tmp_path / "v1.json"
    options = V1Options(model_shape="tiny_qwen3_vl", clips=clips, workdir=tmp_path / "work", requests=4, output_tokens=8,
                        warmup=2, hf_requests=4, hf_batches=(2,), device="cpu")
    assert run(options, out, MediaConfig(), WorkerConfig(preprocess_workers=1), {})
    report = json.loads(out.read_text())
    assert report["peers"]["vllm"] == {"status": "skipped", "reason": "vLLM runs on CUDA GPUs only"}
    assert report["errors"] == {} and report["fairness_problems"] == []
    ours = report["runs"]["paged"]
    assert ours["requests"] == 4 and ours["output_tokens"] == 32 and ours["lengths_as_forced"]
    assert ours["tower_items"] == 4 and ours["encoder_cache_hits"] == 0 and ours["phases"]["num_prefix_hit_tokens"] == 0
    assert ours["prompt_tokens"] == [report["clips"][0]["prompt_tokens"]]
    hf = report["runs"]["hf-generate-b2"]
    assert hf["requests"] == 4 and hf["output_tokens"] == 32 and hf["extra"]["warmup_requests"] == 2
    results = pq.read_table(next((tmp_path / "work" / "jobs" / "timed").glob("*/results"))).to_pylist()
    assert len(results) == 4 and all(r["error"] is None and r["num_generated_tokens"] == 8 for r in results)
    assert sorted(r["id"] for r in results) == [f"v1-{i:04d}" for i in range(4)]


def test_the_command_refuses_unknown_peers_and_modes(tmp_path):
    from typer.testing import CliRunner

    from vlmbatch.cli.commands import app

    for flag, value in (("--peer", "sglang"), ("--vllm-modes", "mmap")):
        result = CliRunner().invoke(app, ["bench", "video-v1", "--model-shape", "tiny_qwen3_vl", flag, value, "--clips", str(tmp_path)])
        assert result.exit_code == 2 and value in result.output, result.output
