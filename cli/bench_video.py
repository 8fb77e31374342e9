"""`vlmbatch bench video`: frames/s and requests/s of each video backend, with `ffmpeg` as the reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from vlmbatch.cli.bench_options import int_list


def bench_video(
    backends: Optional[str] = typer.Option(None, "--backends", help="Comma-separated backends (default: every installed one; NVDEC only with a GPU)."),
    frames: str = typer.Option("16,64", "--frames", help="Uniformly sampled frames per request."),
    threads: Optional[str] = typer.Option(None, "--threads", help="Concurrent loader threads (default: 1 and the CPU count)."),
    requests_per_thread: int = typer.Option(1, "--requests-per-thread", min=1, help="Requests each thread serves per measurement."),
    seconds: int = typer.Option(60, "--seconds", min=1, help="Clip length."),
    size: str = typer.Option("1280x720", "--size", help="Clip size WxH."),
    clip_dir: Path = typer.Option(Path("bench-out/video-clips"), "--clip-dir", help="Where the generated clips are kept between runs."),
    json_out: Path = typer.Option(Path("bench-out/video.json"), "--json", help="Where to write the figures."),
    decoder_threads: int = typer.Option(
        0, "--decoder-threads", min=0,
        help="Threads each decoder may use (0: each library's default; jobs' preprocessing workers use 1).",
    ),
) -> None:
    """Decode 16 and 64 uniformly sampled frames of a 720p h264 clip with every backend."""
    from vlmbatch.bench.video import default_backends, run
    from vlmbatch.media.video.options import BACKENDS

    chosen = backends.split(",") if backends else default_backends()
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise typer.BadParameter(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}", param_hint="--backends")
    thread_counts = list(int_list(threads, "--threads")) if threads else sorted({1, os.cpu_count() or 1})
    run(chosen, list(int_list(frames, "--frames")), thread_counts, requests_per_thread, seconds, size, clip_dir, json_out, decoder_threads)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("video")(bench_video)
