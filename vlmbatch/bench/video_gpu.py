"""`vlmbatch bench video-gpu`: NVDEC colour, NVDEC vs OpenCV throughput, GPU frames into the processor.

The GPU machine has no ffmpeg and its OpenCV cannot encode h264, so make the h264 clips
where ffmpeg exists (into an ignored folder) and carry them (docs/video.md):

    vlmbatch bench video-gpu --make-clips bench-out/gpu-video-clips      # CPU box, ffmpeg
    vlmbatch bench video-gpu --clips bench-out/gpu-video-clips --json $OUT/gpu_video_check.json
    vlmbatch bench video-gpu --clips bench-out/gpu-video-clips --no-nvdec   # CPU parts only, anywhere

PyNvVideoCodec must be importable for the NVDEC parts (on the device: install its carried
wheel with `pip install --no-deps --target DIR` and put DIR on PYTHONPATH).

1. Colour: every frame of a 10 s untagged and a 10 s BT.709-tagged 720p h264 clip,
   decoded with PyNvVideoCodec's own RGB ("before"), with the vlmbatch backend (NV12 +
   FFmpeg's matrix, "after") and with OpenCV: per-frame mean absolute difference to
   OpenCV, and which colour matrix explains the "before" difference. Goal: "after" <= 2/255.
2. Throughput: 16 and 64 uniformly sampled frames per request from two 60 s 720p h264
   clips (the encoder's keyframe spacing; one keyframe per second), `pynvvideocodec` vs
   `opencv` (FFmpeg's default threads: all cores), one request at a time
   (`vlmbatch.bench.video`): frames/s, requests/s, CPU seconds per request.
3. GPU frames: NVDEC-decoded frames go through the tiny Qwen2.5-VL adapter as CUDA
   tensors and as host numpy (`vlmbatch.testing.gpu_frames`): `pixel_values_videos` must
   be on CUDA, the token ids and grids identical, the pixels within tolerance; and the
   cost of `media_hash` on a CUDA clip (a full host copy) next to a numpy one.
`run` returns False if a check fails; `--json` keeps every figure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

LIMIT = 2.0


def import_pynvvideocodec():
    try:
        import PyNvVideoCodec as nvc
    except ImportError as exc:
        raise RuntimeError("PyNvVideoCodec is not importable (install its wheel, or use --no-nvdec)") from exc
    print(f"PyNvVideoCodec {nvc.__version__}")
    return nvc


def make_clip(path: Path, seconds: int, tagged_bt709: bool = False) -> Path | None:
    """A 720p testsrc2 clip: h264 (libx264's keyframe spacing) with ffmpeg, else whatever OpenCV can encode."""
    if shutil.which("ffmpeg"):
        colour = ["-vf", "scale=out_color_matrix=bt709", "-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709"] if tagged_bt709 else []
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i", f"testsrc2=size=1280x720:rate=30:duration={seconds}",
             *colour, "-c:v", "libx264", "-preset", "veryfast", "-crf", "28", "-pix_fmt", "yuv420p", str(path)],
            check=True,
        )
        return path
    if tagged_bt709:
        return None
    import cv2
    import numpy as np

    for fourcc in ("avc1", "H264", "mp4v"):
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 30.0, (1280, 720))
        if writer.isOpened():
            break
    print(f"ffmpeg not found: writing {path.name} with OpenCV fourcc {fourcc}")
    yy, xx = np.mgrid[0:720, 0:1280 + 30 * 4]
    pattern = np.stack([xx % 256, (yy + xx // 3) % 256, ((xx + yy) // 4) % 256], axis=-1).astype(np.uint8)
    for i in range(seconds * 30):
        frame = np.ascontiguousarray(pattern[:, (4 * i) % 120 : (4 * i) % 120 + 1280])
        cv2.putText(frame, f"frame {i}", (80, 360), cv2.FONT_HERSHEY_SIMPLEX, 4, (255, 255, 255), 8)
        writer.write(frame)
    writer.release()
    return path


def opencv_all_frames(path: Path):
    import cv2

    capture = cv2.VideoCapture(str(path))
    frames = []
    started = time.perf_counter()
    while True:
        ok, bgr = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    return frames, time.perf_counter() - started


def per_frame_diff(gpu_frames, cpu_frames):
    import numpy as np
    import torch

    cpu = torch.from_numpy(np.stack(cpu_frames)).cuda().to(torch.int16)
    return (gpu_frames.to(torch.int16) - cpu).abs().float().mean(dim=(1, 2, 3)).cpu()


def colour_check(nvc, path: Path) -> dict:
    import torch

    from vlmbatch.media.video import load_video, parse_video_options
    from vlmbatch.media.video.gpu import nv12_to_rgb

    cpu_frames, cpu_seconds = opencv_all_frames(path)
    count = len(cpu_frames)
    decoder = nvc.SimpleDecoder(str(path), gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.RGB)
    print(f"\n== {path.name}: {count} frames (OpenCV), {len(decoder)} (NVDEC); metadata: {decoder.get_stream_metadata()}")
    started = time.perf_counter()
    library_rgb = torch.stack([torch.from_dlpack(f) for f in decoder.get_batch_frames_by_index(list(range(count)))])
    torch.cuda.synchronize()
    nvdec_seconds = time.perf_counter() - started
    before = per_frame_diff(library_rgb, cpu_frames)
    print(f"before (PyNvVideoCodec RGB) vs OpenCV: mean {before.mean():.3f}/255, min {before.min():.3f}, max {before.max():.3f}")

    native = nvc.SimpleDecoder(str(path), gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.NATIVE)
    nv12 = torch.from_dlpack(native[0]).clone()
    for matrix in ("bt601", "bt709"):
        for full in (False, True):
            candidate = nv12_to_rgb(nv12, matrix, full)
            print(f"  frame 0 as {matrix} {'full' if full else 'limited'}: library RGB differs by "
                  f"{(candidate.int() - library_rgb[0].int()).abs().float().mean():.3f}, OpenCV by "
                  f"{per_frame_diff(candidate[None], cpu_frames[:1])[0]:.3f}")
    try:
        demuxer = nvc.CreateDemuxer(str(path))
        print(f"  demuxer ColorSpace={demuxer.ColorSpace()} ColorRange={demuxer.ColorRange()}")
    except Exception as exc:  # informational only: the names are read from the library's binary
        print(f"  demuxer colour query failed: {exc!r}")

    started = time.perf_counter()
    ours = load_video(str(path), parse_video_options({"backend": "pynvvideocodec", "num_frames": count, "max_frames": count}))
    torch.cuda.synchronize()
    ours_seconds = time.perf_counter() - started
    assert ours.frames.is_cuda, "frames should stay on the GPU"
    after = per_frame_diff(ours.frames, [cpu_frames[i] for i in ours.frame_indices])
    print(f"after (vlmbatch NV12 -> RGB) vs OpenCV: mean {after.mean():.3f}/255, min {after.min():.3f}, max {after.max():.3f} "
          f"over {ours.num_frames} frames")
    print(f"full decode: OpenCV {count / cpu_seconds:.0f} fps, NVDEC (library RGB) {count / nvdec_seconds:.0f} fps, "
          f"vlmbatch pynvvideocodec {ours.num_frames / ours_seconds:.0f} fps (incl. probe)")
    return {
        "clip": path.name, "frames": ours.num_frames,
        "before_mean": float(before.mean()), "before_max": float(before.max()),
        "after_mean": float(after.mean()), "after_max": float(after.max()),
        "full_decode_fps": {"opencv": count / cpu_seconds, "nvdec_library_rgb": count / nvdec_seconds,
                            "vlmbatch_pynvvideocodec": ours.num_frames / ours_seconds},
    }


LONG_CLIP = {"seconds": 60, "width": 1280, "height": 720, "crf": 30}  # crf 30: both clips fit the upload limit (~16 MB)


def throughput(clip_dir: Path, backends: list[str], requests: int) -> list[dict]:
    """Sampled-frame loads, one request at a time, on both 60 s clips (`vlmbatch bench video`'s loop)."""
    from vlmbatch.bench.video import run_video_bench

    print(f"\n== sampled-frame throughput, 60 s 720p h264, one request at a time, {os.cpu_count()} CPU cores")
    print(f"  {'clip':12s} {'frames':>6s} {'backend':15s} {'frames/s':>9s} {'requests/s':>10s} {'CPU s/req':>9s}  same frames")

    def show(r) -> None:
        print(f"  {r.clip:12s} {r.frames:6d} {r.backend:15s} {r.frames_per_s:9.1f} {r.requests_per_s:10.2f} "
              f"{r.cpu_seconds / r.requests:9.2f}  {r.frame_indices_match}")

    results = run_video_bench(clip_dir, backends, [16, 64], [1], requests, LONG_CLIP["seconds"], LONG_CLIP["width"],
                              LONG_CLIP["height"], on_result=show, crf=LONG_CLIP["crf"])
    return [asdict(r) for r in results]


def gpu_frames_check(clip_dir: Path, backend: str, device: str) -> dict:
    """Frames from `backend` through the tiny Qwen2.5-VL adapter on `device` vs the host path,
    and what hashing a 64-frame clip costs from the device and from numpy."""
    import numpy as np
    import torch

    from vlmbatch.media.video import load_video, parse_video_options
    from vlmbatch.bench.video import make_bench_clip
    from vlmbatch.families.processor_adapter import media_hash
    from vlmbatch.families.registry import load_adapter
    from vlmbatch.testing.gpu_frames import MAX_ABS_DIFF, MEAN_ABS_DIFF, compare_on_device, within_tolerance
    from vlmbatch.testing.tiny import make_tiny_model

    path = make_bench_clip(clip_dir, "default_gop", LONG_CLIP["seconds"], LONG_CLIP["width"], LONG_CLIP["height"],
                           crf=LONG_CLIP["crf"])
    adapter = load_adapter(str(make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-qwen-")), "qwen2_5_vl")))
    video = load_video(str(path), parse_video_options({"backend": backend, "num_frames": 16}))
    result = compare_on_device(adapter, video, device)
    result.update(backend=backend, decoded_on=str(getattr(video.frames, "device", "cpu")),
                  tolerance={"max_abs_diff": MAX_ABS_DIFF, "mean_abs_diff": MEAN_ABS_DIFF})
    result["ok"] = within_tolerance(result) and result["device"].startswith(device)
    long = load_video(str(path), parse_video_options({"backend": backend, "num_frames": 64}))
    frames = long.frames if isinstance(long.frames, torch.Tensor) else torch.from_numpy(long.frames)
    hash_ms = {}
    for name, pixels in (("numpy", frames.cpu().numpy()), (device, frames.to(device))):
        media_hash(replace(long, frames=pixels))  # warm
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        media_hash(replace(long, frames=pixels))
        hash_ms[name] = 1000 * (time.perf_counter() - started)
    result["media_hash_ms_64x720p"] = hash_ms
    result["real_size"] = [real_size_processing(v, device) for v in (video, long)]
    print(f"\n== GPU frames into the processor (tiny Qwen2.5-VL, {backend} frames on {result['decoded_on']})")
    print(f"  pixel_values_videos on {result['device']}; tokens equal {result['tokens_equal']}, grids equal "
          f"{result['grid_equal']}, hashes equal {result['hash_equal']}; vs the host path: max {result['max_abs_diff']:.4f} "
          f"(limit {MAX_ABS_DIFF}), mean {result['mean_abs_diff']:.5f} (limit {MEAN_ABS_DIFF}) -> "
          f"{'ok' if result['ok'] else 'FAILED'}")
    print(f"  media_hash of 64 frames {tuple(np.shape(frames))}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in hash_ms.items()))
    for r in result["real_size"]:
        print(f"  Qwen2.5-VL-size video processor, {r['frames']} frames: pixel_values_videos {r['shape']} "
              f"({r['megabytes']:.0f} MB float32, {r['tokens']} tokens); host {r['host_ms']:.0f} ms, "
              f"{device} {r['device_ms']:.0f} ms; max diff {r['max_abs_diff']:.4f}, mean {r['mean_abs_diff']:.5f}")
    result["ok"] = result["ok"] and all(r["ok"] for r in result["real_size"])
    return result


def real_size_processing(video, device: str) -> dict:
    """The video processor at the library's (Qwen2.5-VL's) frame sizes, not the tiny
    checkpoint's: what keeping frames on the GPU saves per row, and what a row's
    `pixel_values_videos` then occupies on the device."""
    import torch
    from transformers import Qwen2VLVideoProcessor

    from vlmbatch.testing.gpu_frames import MAX_ABS_DIFF, MEAN_ABS_DIFF

    processor = Qwen2VLVideoProcessor()
    options = {"do_sample_frames": False, "return_tensors": "pt"}
    if getattr(processor, "cap_pixels_per_frame", False) is None:  # as the adapter chooses
        options["cap_pixels_per_frame"] = True
    frames = video.frames if isinstance(video.frames, torch.Tensor) else torch.from_numpy(video.frames)
    host_frames, device_frames = frames.cpu().numpy(), frames.to(device)
    timings = {}
    for name, pixels, extra in (("host", host_frames, {}), ("device", device_frames, {"device": device})):
        for _ in range(2):  # the first call warms kernels and allocators
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = processor(videos=[pixels], **options, **extra)
            if device != "cpu":
                torch.cuda.synchronize()
            timings[name] = (1000 * (time.perf_counter() - started), out)
    host, on_device = timings["host"][1]["pixel_values_videos"], timings["device"][1]["pixel_values_videos"]
    diff = (on_device.float().cpu() - host).abs()
    grid = timings["host"][1]["video_grid_thw"]
    result = {
        "frames": int(frames.shape[0]), "shape": list(host.shape), "on": str(on_device.device),
        "megabytes": host.numel() * host.element_size() / 1e6, "tokens": int(grid.prod()) // 4,
        "host_ms": timings["host"][0], "device_ms": timings["device"][0],
        "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
    }
    result["ok"] = (result["on"].startswith(device) and torch.equal(timings["device"][1]["video_grid_thw"].cpu(), grid)
                    and result["max_abs_diff"] <= MAX_ABS_DIFF and result["mean_abs_diff"] <= MEAN_ABS_DIFF)
    return result


# Colour clips: name -> (seconds, tagged BT.709); the 60 s clips come from `make_bench_clip`.
CLIPS = {"untagged_720p.mp4": (10, False), "bt709_720p.mp4": (10, True)}


def make_clips(directory: Path) -> dict[str, Path | None]:
    """The clip set in `directory`, making those that are missing (None: cannot be made here)."""
    from vlmbatch.bench.video import CLIP_KINDS, make_bench_clip

    directory.mkdir(parents=True, exist_ok=True)
    clips: dict[str, Path | None] = {}
    for name, (seconds, tagged) in CLIPS.items():
        path = directory / name
        if not path.exists():
            partial = path.with_suffix(".partial.mp4")  # an interrupted run leaves no half clip behind
            if make_clip(partial, seconds, tagged_bt709=tagged) is not None:
                partial.replace(path)
        clips[name] = path if path.exists() else None
    for label in CLIP_KINDS:
        name = f"{label}_{LONG_CLIP['width']}x{LONG_CLIP['height']}_{LONG_CLIP['seconds']}s_crf{LONG_CLIP['crf']}.mp4"
        if (directory / name).exists() or shutil.which("ffmpeg"):
            clips[name] = make_bench_clip(directory, label, LONG_CLIP["seconds"], LONG_CLIP["width"], LONG_CLIP["height"],
                                          crf=LONG_CLIP["crf"])
        else:
            clips[name] = None
    for name, path in clips.items():
        size = f"{path.stat().st_size / 1e6:.1f} MB" if path else "not available (needs ffmpeg)"
        print(f"clip {name}: {path or ''} {size}")
    return clips


def run(clips_dir: Path | None, no_nvdec: bool, requests: int, json_out: Path | None) -> bool:
    """The checks on the clips in `clips_dir` (made there when missing and ffmpeg exists);
    True when every one passed."""
    import torch

    sys.stdout.reconfigure(line_buffering=True)  # a run cut short still shows what it measured
    clip_dir = clips_dir or Path(tempfile.mkdtemp(prefix="gpu-video-"))
    clips = make_clips(clip_dir)
    report: dict = {"cpu_cores": os.cpu_count(), "nvdec": not no_nvdec, "colour": [], "colour_limit": LIMIT}
    if no_nvdec:
        backends, device = ["opencv"], "cpu"
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device (use --no-nvdec for the CPU parts)")
        nvc = import_pynvvideocodec()
        report["device"] = torch.cuda.get_device_name()
        backends, device = ["pynvvideocodec", "opencv"], "cuda"
        for name in CLIPS:
            if clips.get(name) is not None:
                report["colour"].append(colour_check(nvc, clips[name]))
    ok = all(c["after_max"] <= LIMIT for c in report["colour"])
    long_clips = [name for name in clips if name not in CLIPS]
    if all(clips[name] is not None for name in long_clips):
        report["throughput"] = throughput(clip_dir, backends, requests)
        report["gpu_frames"] = gpu_frames_check(clip_dir, backends[0], device)
        ok = ok and report["gpu_frames"]["ok"] and all(r["frame_indices_match"] for r in report["throughput"])
    else:
        print("the 60 s clips are missing: make them with --make-clips where ffmpeg exists")
        ok = False
    if report["colour"]:
        worst = max(c["after_max"] for c in report["colour"])
        print(f"\nworst per-frame colour difference after the fix: {worst:.3f}/255 (limit {LIMIT})")
    report["ok"] = ok
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_out}")
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return ok
