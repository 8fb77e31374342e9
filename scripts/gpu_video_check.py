#!/usr/bin/env python3
"""Device check for the NVDEC backend: colour agreement with OpenCV, and throughput.

The GPU machine has no ffmpeg and its OpenCV cannot encode h264, so make the
h264 clips here first (into an ignored folder) and carry them with the wheel:

    python3 scripts/gpu_video_check.py --make-clips bench-out/gpu-video-clips      # CPU box, ffmpeg
    python3 scripts/gpu_video_check.py --clips bench-out/gpu-video-clips           # GPU machine
    (carry: .whl/pynvvideocodec-2.2.4-cp312-cp312-manylinux_2_28_x86_64.whl, bench-out/gpu-video-clips)

The wheel is installed into a temporary folder if PyNvVideoCodec is not importable.
Without `--clips` the clips are made on the spot (ffmpeg, else OpenCV's VideoWriter,
which on the GPU machine writes MPEG-4 part 2, not h264).

1. Clips, 720p: 10 s untagged h264, 10 s h264 tagged BT.709, 60 s with the
   encoder's keyframe spacing and 60 s with one keyframe per second.
2. Decodes every frame with PyNvVideoCodec's own RGB ("before") and with the
   vlmbatch backend (NV12 + FFmpeg's matrix, "after"), and with OpenCV; prints the
   per-frame mean absolute difference to OpenCV, and which colour matrix explains
   the "before" difference.
3. Times 16 and 64 uniformly sampled frames from the 60 s clip per request:
   NVDEC vs OpenCV (all cores), frames/s and requests/s.
Exits 1 if any "after" frame differs from OpenCV by more than 2/255 on average.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LIMIT = 2.0


def import_pynvvideocodec():
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError:
        wheels = sorted(glob.glob(str(REPO / ".whl" / "pynvvideocodec-*.whl")))
        if not wheels:
            sys.exit("PyNvVideoCodec is not installed and no wheel is in .whl/ (carry it)")
        target = tempfile.mkdtemp(prefix="pynvc-")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheels[-1]], check=True)
        sys.path.insert(0, target)
    import PyNvVideoCodec as nvc

    print(f"PyNvVideoCodec {nvc.__version__}")
    return nvc


def make_clip(path: Path, seconds: int, tagged_bt709: bool = False, keyint: int = 250) -> Path | None:
    if shutil.which("ffmpeg"):
        colour = ["-vf", "scale=out_color_matrix=bt709", "-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709"] if tagged_bt709 else []
        subprocess.run(
            ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i", f"testsrc2=size=1280x720:rate=30:duration={seconds}",
             *colour, "-c:v", "libx264", "-preset", "veryfast", "-crf", "28", "-pix_fmt", "yuv420p", "-g", str(keyint), str(path)],
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


def colour_check(nvc, path: Path) -> float:
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
    return float(after.max())


def throughput(path: Path, repeats: int = 5) -> None:
    import torch

    from vlmbatch.media.video import load_video, parse_video_options

    print(f"\n== sampled-frame throughput, {path.name} (60 s 720p h264), {os.cpu_count()} CPU cores")
    for frames in (16, 64):
        for backend in ("opencv", "pynvvideocodec"):
            options = parse_video_options({"backend": backend, "num_frames": frames})
            load_video(str(path), options)  # warm-up: decoder sessions, CUDA context
            started = time.perf_counter()
            for _ in range(repeats):
                load_video(str(path), options)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - started) / repeats
            print(f"  {frames:3d} frames  {backend:15s} {frames / seconds:8.1f} frames/s  {1 / seconds:6.2f} requests/s")


# name -> (seconds, tagged BT.709, keyframe interval)
CLIPS = {
    "untagged_720p.mp4": (10, False, 250),
    "bt709_720p.mp4": (10, True, 250),
    "long_720p.mp4": (60, False, 250),
    "long_720p_key1s.mp4": (60, False, 30),
}


def make_clips(directory: Path) -> dict[str, Path | None]:
    """The clip set in `directory`, making those that are missing (None: cannot be made here)."""
    directory.mkdir(parents=True, exist_ok=True)
    clips: dict[str, Path | None] = {}
    for name, (seconds, tagged, keyint) in CLIPS.items():
        path = directory / name
        if not path.exists() and (keyint == 250 or shutil.which("ffmpeg")):
            partial = path.with_suffix(".partial.mp4")  # an interrupted run leaves no half clip behind
            if make_clip(partial, seconds, tagged_bt709=tagged, keyint=keyint) is not None:
                partial.replace(path)
        clips[name] = path if path.exists() else None
        print(f"clip {name}: {path if path.exists() else 'not available (needs ffmpeg)'}")
    return clips


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", help="folder of pre-made clips (made with --make-clips where ffmpeg exists)")
    parser.add_argument("--make-clips", metavar="DIR", help="only make the clips into DIR (needs ffmpeg for h264) and exit")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # a run cut short still shows what it measured
    if args.make_clips:
        make_clips(Path(args.make_clips))
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    nvc = import_pynvvideocodec()
    clips = make_clips(Path(args.clips) if args.clips else Path(tempfile.mkdtemp(prefix="gpu-video-")))
    worst = 0.0
    for name in ("untagged_720p.mp4", "bt709_720p.mp4"):
        if clips.get(name) is not None:
            worst = max(worst, colour_check(nvc, clips[name]))
    for name in ("long_720p.mp4", "long_720p_key1s.mp4"):
        if clips.get(name) is not None:
            throughput(clips[name])
    print(f"\nworst per-frame difference after the fix: {worst:.3f}/255 (limit {LIMIT})")
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
