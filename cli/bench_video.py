"""`vlmbatch bench video`: frames/s and requests/s of each video backend, with `ffmpeg` as the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table


def _default_backends() -> list[str]:
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


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers", param_hint=flag)
    if not values or min(values) < 1:
        raise typer.BadParameter("expected positive integers", param_hint=flag)
    return values


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
    from vlmbatch.media.video.bench import results_as_json, run_video_bench
    from vlmbatch.media.video.options import BACKENDS

    chosen = backends.split(",") if backends else _default_backends()
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise typer.BadParameter(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}", param_hint="--backends")
    width, _, height = size.partition("x")
    thread_counts = _int_list(threads, "--threads") if threads else sorted({1, os.cpu_count() or 1})
    frame_counts = _int_list(frames, "--frames")

    console = Console()
    console.width = max(console.width, 110)  # the table stays readable when piped
    table = Table(title=f"video decoding: {seconds} s {size} h264, {os.cpu_count()} CPU cores, "
                        f"{decoder_threads or 'default'} decoder threads")
    for column in ("clip", "frames", "threads", "backend", "frames/s", "requests/s", "vs best", "CPU s/request", "same frames"):
        table.add_column(column, justify="left" if column in ("clip", "backend") else "right", no_wrap=True)

    def show(result) -> None:
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
        clip_dir, chosen, frame_counts, thread_counts, requests_per_thread, seconds, int(width), int(height), on_result=show,
        decoder_threads=decoder_threads,
    )
    console.print(table)
    settings = {"backends": chosen, "frames": frame_counts, "threads": thread_counts, "seconds": seconds, "size": size,
                "requests_per_thread": requests_per_thread, "cpu_count": os.cpu_count(), "decoder_threads": decoder_threads}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(results_as_json(results, settings), indent=2))
    console.print(f"wrote {json_out}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("video")(bench_video)
