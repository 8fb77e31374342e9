"""`vlmbatch bench video`: decoding throughput of each backend against the `ffmpeg`
command line on the same frames.

For a 720p h264 clip (encoder-default keyframe spacing, and one keyframe per
second) and 16 / 64 uniformly sampled frames, every backend serves `requests`
loads on `threads` concurrent loader threads (how a worker loads media); the
`ffmpeg` CLI extracting the same frames, in the same run, is the reference.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.table import Table

from vlmbatch.media.video import load_video, parse_video_options
from vlmbatch.media.video.options import set_cpu_decoder_threads
from vlmbatch.media.video.probe import probe_stream
from vlmbatch.media.video.sampling import plan_frames
from vlmbatch.media.refs import MediaSource

T = TypeVar("T")

# Clip label -> keyframe interval in frames (None: libx264's default, 250).
CLIP_KINDS = {"default_gop": None, "keyframe_1s": 30}


@dataclass
class BenchResult:
    clip: str
    backend: str
    frames: int
    threads: int
    requests: int
    seconds: float
    cpu_seconds: float
    frames_per_s: float
    requests_per_s: float
    frame_indices_match: bool = True
    slowdown_vs_best: float = 1.0


def make_bench_clip(
    directory: Path, label: str, seconds: int, width: int, height: int, fps: int = 30, crf: int | None = None
) -> Path:
    """A `testsrc2` h264 clip, made once and kept in `directory` (encoding is the slow part).

    `crf` (libx264's default 23 if None) trades size for quality: clips carried to the GPU
    machine use a higher one to fit its upload limit."""
    keyint = CLIP_KINDS[label]
    quality = f"_crf{crf}" if crf is not None else ""
    path = directory / f"{label}_{width}x{height}_{seconds}s{quality}.mp4"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    gop = ["-g", str(keyint)] if keyint else []
    rate = ["-crf", str(crf)] if crf is not None else []
    partial = path.with_suffix(".partial.mp4")
    subprocess.run(
        ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi",
         "-i", f"testsrc2=size={width}x{height}:rate={fps}:duration={seconds}",
         "-c:v", "libx264", "-preset", "veryfast", *rate, "-pix_fmt", "yuv420p", *gop, str(partial)],
        check=True,
    )
    partial.replace(path)
    return path


def sampled_indices(path: Path, frames: int) -> list[int]:
    index = probe_stream(MediaSource(name=path.name, path=str(path)))
    return plan_frames(index.timestamps, parse_video_options({"num_frames": frames})).indices


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the ffmpeg CLI runs as one)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def time_requests(load_once: Callable[[], T], requests: int, threads: int) -> tuple[float, float, list[T]]:
    """Wall and CPU seconds of `requests` calls on `threads` threads, and what they returned.

    CPU seconds are the figure to compare on a shared machine, where wall time
    depends on what else runs.
    """
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        returned = list(pool.map(lambda _: load_once(), range(requests)))
    return time.perf_counter() - started, _cpu_seconds() - cpu_started, returned


def ffmpeg_extract(path: Path, indices: Sequence[int]) -> None:
    """The reference: the `ffmpeg` CLI decoding the clip and keeping the same frames as RGB."""
    selection = "+".join(f"eq(n\\,{i})" for i in sorted(set(indices)))
    subprocess.run(
        ["ffmpeg", "-hide_banner", "-loglevel", "error", "-i", str(path), "-vf", f"select='{selection}'",
         "-fps_mode", "passthrough", "-pix_fmt", "rgb24", "-f", "rawvideo", "-"],
        check=True, stdout=subprocess.DEVNULL,
    )


def run_video_bench(
    clip_dir: Path,
    backends: Sequence[str],
    frame_counts: Sequence[int],
    thread_counts: Sequence[int],
    requests_per_thread: int,
    seconds: int,
    width: int,
    height: int,
    on_result: Callable[[BenchResult], None] = lambda result: None,
    crf: int | None = None,
    decoder_threads: int = 0,
) -> list[BenchResult]:
    """Each backend's time and CPU for `frame_counts` sampled frames of each clip kind, with
    `thread_counts` concurrent requests; decoders use `decoder_threads` threads each (0: the
    libraries' defaults; jobs' preprocessing workers use 1)."""
    set_cpu_decoder_threads(decoder_threads)
    results: list[BenchResult] = []
    for label in CLIP_KINDS:
        path = make_bench_clip(clip_dir, label, seconds, width, height, crf=crf)
        for backend in backends:  # not timed: library imports (torch), CUDA context, decoder sessions
            load_video(str(path), parse_video_options({"backend": backend, "num_frames": 2, "max_duration": 1.0}))
        for frames in frame_counts:
            expected = sampled_indices(path, frames)
            for threads in thread_counts:
                requests = threads * requests_per_thread
                group: list[BenchResult] = []
                if shutil.which("ffmpeg"):
                    elapsed, cpu, _ = time_requests(lambda: ffmpeg_extract(path, expected), requests, threads)
                    group.append(_result(label, "ffmpeg-cli", frames, threads, requests, elapsed, cpu, True))
                for backend in backends:
                    options = parse_video_options({"backend": backend, "num_frames": frames})
                    elapsed, cpu, loaded = time_requests(lambda: load_video(str(path), options), requests, threads)
                    matched = all(video.frame_indices == expected for video in loaded)
                    group.append(_result(label, backend, frames, threads, requests, elapsed, cpu, matched))
                best = min(r.seconds for r in group if r.backend != "ffmpeg-cli") if backends else 0.0
                for result in group:
                    result.slowdown_vs_best = result.seconds / best if best else 1.0
                    on_result(result)
                results.extend(group)
    return results


def _result(
    clip: str, backend: str, frames: int, threads: int, requests: int, elapsed: float, cpu: float, matched: bool
) -> BenchResult:
    return BenchResult(
        clip=clip, backend=backend, frames=frames, threads=threads, requests=requests, seconds=elapsed, cpu_seconds=cpu,
        frames_per_s=frames * requests / elapsed, requests_per_s=requests / elapsed, frame_indices_match=matched,
    )


def results_as_json(results: Sequence[BenchResult], settings: dict) -> dict:
    return {"benchmark": "video", "settings": settings, "results": [asdict(r) for r in results]}


def default_backends() -> list[str]:
    """Every installed backend; NVDEC only where there is a GPU."""
    from vlmbatch.media.video import ensure_backend_available

    available = []
    for backend in ("opencv", "pyav", "torchcodec", "pynvvideocodec"):
        try:
            ensure_backend_available(backend)
        except ValueError:
            continue
        available.append(backend)
    if "pynvvideocodec" in available:
        import torch

        if not torch.cuda.is_available():
            available.remove("pynvvideocodec")
    return available


def run(backends: list[str], frame_counts: list[int], thread_counts: list[int], requests_per_thread: int, seconds: int,
        size: str, clip_dir: Path, json_out: Path, decoder_threads: int) -> None:
    """The command: progress lines, then a table; every figure goes to `json_out`."""
    width, _, height = size.partition("x")
    console = Console()
    console.width = max(console.width, 110)  # the table stays readable when piped
    table = Table(title=f"video decoding: {seconds} s {size} h264, {os.cpu_count()} CPU cores, "
                        f"{decoder_threads or 'default'} decoder threads")
    for column in ("clip", "frames", "threads", "backend", "frames/s", "requests/s", "vs best", "CPU s/request", "same frames"):
        table.add_column(column, justify="left" if column in ("clip", "backend") else "right", no_wrap=True)

    def show(result: BenchResult) -> None:
        console.print(  # progress: a full run takes minutes on a small machine
            f"{result.clip} {result.frames} frames, {result.threads} threads, {result.backend}: "
            f"{result.frames_per_s:,.1f} frames/s, {result.requests_per_s:,.2f} requests/s"
        )
        table.add_row(
            result.clip, str(result.frames), str(result.threads), result.backend, f"{result.frames_per_s:,.1f}",
            f"{result.requests_per_s:,.2f}", f"{result.slowdown_vs_best:.2f}x", f"{result.cpu_seconds / result.requests:.2f}",
            "yes" if result.frame_indices_match else "NO",
        )

    results = run_video_bench(
        clip_dir, backends, frame_counts, thread_counts, requests_per_thread, seconds, int(width), int(height), on_result=show,
        decoder_threads=decoder_threads,
    )
    console.print(table)
    settings = {"backends": backends, "frames": frame_counts, "threads": thread_counts, "seconds": seconds, "size": size,
                "requests_per_thread": requests_per_thread, "cpu_count": os.cpu_count(), "decoder_threads": decoder_threads}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(results_as_json(results, settings), indent=2))
    console.print(f"wrote {json_out}")
