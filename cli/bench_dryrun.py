"""`vlmbatch bench dryrun`: validation speed and memory of `submit --dry-run` on Parquet of small images."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def dryrun(
    model: str = typer.Option(..., "--model", "-m", help="Model whose processor validates the rows (tiny checkpoints work)."),
    rows: str = typer.Option("10000,100000", "--rows", help="Comma-separated dataset sizes."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where the generated Parquet files go (default: a temp folder)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Rows/s and peak RSS of the dry-run on generated Parquet files of small images."""
    from vlmbatch.bench.dryrun import run

    run(model, [int(r) for r in rows.split(",")], workdir, json_out)


def register(bench_app: typer.Typer) -> None:
    bench_app.command()(dryrun)
