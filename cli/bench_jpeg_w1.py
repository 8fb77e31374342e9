"""`vlmbatch bench jpeg-w1`: W1 pre-decoded, from JPEG bytes decoded on the GPU, and decoded on the CPU, through one engine."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit


def bench_jpeg_w1(
    shape: str = model_shape_option(),
    rows: int = typer.Option(1024, "--rows", min=1, help="W1 requests per run."),
    workdir: Path = typer.Option(Path("bench-out"), "--workdir", help="Model folder, datasets and job outputs."),
    json_out: Path = typer.Option(Path("bench-out/gpu_jpeg_w1.json"), "--json", help="Where to write the figures."),
) -> None:
    """Requests/s of W1 with pixels ready, through the job path from JPEGs with nvJPEG in the engine, and with the pool decoding."""
    from vlmbatch.bench.jpeg_w1 import run
    from vlmbatch.config import MediaConfig, WorkerConfig

    shape = shape_or_exit(shape).name
    if not run(shape, rows, workdir, json_out, WorkerConfig.from_env(os.environ), MediaConfig.from_env(os.environ)):
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("jpeg-w1")(bench_jpeg_w1)
