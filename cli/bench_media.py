"""`vlmbatch bench media`: images/s of decode + resize + normalise of 1080p JPEGs to the
model's input, per path (Pillow in one process, the CPU pool with 1..N processes, nvJPEG
on the GPU); prints a table and writes JSON (see BENCHMARKS.md and docs/preprocessing.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table


def bench_media(
    side: int = typer.Option(448, "--side", min=28, help="Model input: a pixel budget of side x side."),
    images: int = typer.Option(256, "--images", min=8, help="Images per CPU-pool measurement (x4 on the GPU)."),
    max_workers: Optional[int] = typer.Option(None, "--max-workers", min=1, help="Largest pool size (default: the usable cores)."),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--no-gpu", help="Include the nvJPEG path (default: when CUDA is present)."),
    memory_rows: Optional[int] = typer.Option(
        None, "--memory-rows", min=1,
        help="Instead: peak RSS while this many rows of a generated Parquet file go through the job's pool.",
    ),
    output: Path = typer.Option(Path("bench-out/media.json"), "--output", "-o", help="JSON results file."),
) -> None:
    """Decode + resize + normalise throughput per preprocessing path."""
    from vlmbatch.media.bench import pool_memory, run_media_bench

    err = Console(stderr=True)
    if memory_rows is not None:
        result = pool_memory(memory_rows, max_workers)
        Console().print_json(data=result)
        _write(output, {"benchmark": "media_pool_memory", **result})
        err.print(f"wrote {output}")
        return
    report = run_media_bench(side, images, max_workers, gpu, log=err.print)
    table = Table(title=f"media preprocessing: 1080p JPEG -> {side}x{side} pixel budget ({report.source})")
    for column in ("path", "processes", "images", "images/s", "vs pillow"):
        table.add_column(column, justify="right")
    pillow = next(r for r in report.results if r.path == "pillow").images_per_s
    for r in report.results:
        workers = str(r.workers) if r.workers else "-"
        table.add_row(r.path, workers, str(r.images), f"{r.images_per_s:.0f}", f"{r.images_per_s / pillow:.1f}x")
    Console().print(table)
    if report.gpu_parity is not None:
        verdict = "ok" if report.ok else "MISMATCH"
        err.print(f"GPU vs CPU pixel_values: {json.dumps(report.gpu_parity)} -> {verdict}")
    _write(output, {"benchmark": "media", **report.to_dict()})
    err.print(f"wrote {output}")
    if not report.ok:
        raise typer.Exit(1)


def _write(output: Path, data: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=2) + "\n")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("media")(bench_media)
