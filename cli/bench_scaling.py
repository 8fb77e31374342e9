"""`vlmbatch bench scaling`: one job through the queue on two GPUs' workers against one GPU's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit


def bench_scaling(
    shape: str = model_shape_option(),
    rows: int = typer.Option(2048, "--rows", min=1, help="Rows of the timed W1 job."),
    shard_size: int = typer.Option(256, "--shard-size", min=1, help="Rows per shard (2048/256 = 8 shards, 4 per GPU in run B)."),
    gpus_a: Optional[str] = typer.Option(None, "--gpus-a", help="Space-separated --gpus values of run A, one `vlmbatch worker` each (default: 0, or cpu)."),
    gpus_b: Optional[str] = typer.Option(None, "--gpus-b", help="Likewise for run B (default: 0,1, or two cpu workers)."),
    redis_server: Path = typer.Option(Path(".whl/redis/redis-server"), "--redis-server", help="The redis-server binary (its libraries beside it)."),
    workdir: Path = typer.Option(Path("/tmp/vlmbatch-scaling"), "--workdir", help="Model, datasets, logs and job outputs."),
    preprocess_workers: Optional[int] = typer.Option(None, "--preprocess-workers", min=0, help="Preprocessing processes per worker process (default: the product's)."),
    timeout: float = typer.Option(300, "--timeout", help="Seconds allowed for start-up and for each job."),
    json_out: Path = typer.Option(Path("bench-out/scaling.json"), "--json", help="Where to write the figures."),
) -> None:
    """Rows/s of run A (one GPU) and run B (two GPUs) on the same W1 job, and where each shard's time went; the 1.9x target is reported."""
    from vlmbatch.bench.scaling import run

    shape = shape_or_exit(shape).name
    if not run(shape, rows, shard_size, gpus_a, gpus_b, redis_server, workdir, preprocess_workers, timeout, json_out, dict(os.environ)):
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("scaling")(bench_scaling)
