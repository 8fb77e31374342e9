"""`vlmbatch bench video-gpu`: the device check of GPU video (NVDEC colour and throughput, GPU frames into the processor)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def bench_video_gpu(
    clips: Optional[Path] = typer.Option(None, "--clips", help="Folder of pre-made clips (made with --make-clips where ffmpeg exists)."),
    make_clips: Optional[Path] = typer.Option(None, "--make-clips", metavar="DIR", help="Only make the clips into DIR (needs ffmpeg for h264) and exit."),
    no_nvdec: bool = typer.Option(False, "--no-nvdec", help="CPU parts only (OpenCV throughput, frames check on the CPU)."),
    requests: int = typer.Option(3, "--requests", min=1, help="Timed requests per backend, clip and frame count."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every figure to this file."),
) -> None:
    """NVDEC colours against OpenCV, NVDEC vs OpenCV sampled-frame throughput, and NVDEC frames through the processor on the GPU."""
    from vlmbatch.bench import video_gpu

    if make_clips is not None:
        video_gpu.make_clips(make_clips)
        return
    try:
        ok = video_gpu.run(clips, no_nvdec, requests, json_out)
    except RuntimeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    if not ok:
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("video-gpu")(bench_video_gpu)
