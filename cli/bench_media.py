"""`vlmbatch bench media`: images/s of decode + resize + normalise of 1080p JPEGs to the
model's input, per path (Pillow in one process, the CPU pool with 1..N processes, nvJPEG
on the GPU); prints a table and writes JSON (see BENCHMARKS.md and docs/preprocessing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def bench_media(
    side: int = typer.Option(448, "--side", min=28, help="Model input: a pixel budget of side x side."),
    images: int = typer.Option(256, "--images", min=8, help="Images per CPU-pool measurement (x4 on the GPU)."),
    max_workers: Optional[int] = typer.Option(None, "--max-workers", min=1, help="Largest pool size (default: the usable cores)."),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--no-gpu", help="Include the nvJPEG path (default: when CUDA is present)."),
    memory_rows: Optional[int] = typer.Option(
        None, "--memory-rows", min=1,
        help="Instead: peak RSS while this many rows of a generated Parquet file go through the job's pool.",
    ),
    output: Path = typer.Option(Path("bench-out/media.json"), "--output", "-o", "--json", help="JSON results file."),
) -> None:
    """Decode + resize + normalise throughput per preprocessing path; exits 1 when the GPU's pixels differ from the CPU's."""
    from vlmbatch.bench.media import run

    if not run(side, images, max_workers, gpu, memory_rows, output):
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("media")(bench_media)
