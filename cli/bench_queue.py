"""`vlmbatch bench queue`: what the queue costs, and how fast it recovers from a crash (`vlmbatch.bench.queue`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer


def queue(
    rows: int = typer.Option(200_000, "--rows", help="Rows in the dataset (the BENCHMARKS.md figure uses 1,000,000)."),
    shard_size: int = typer.Option(10_000, "--shard-size", help="Rows per shard."),
    workers: int = typer.Option(2, "--workers", help="Worker commands to start (one CPU process each)."),
    broker: Optional[str] = typer.Option(None, "--broker", help="Use this Redis instead of a private redis-server."),
    json_out: Path = typer.Option(Path("bench-out/queue.json"), "--json", help="Where to write the figures."),
) -> None:
    """Queue overhead against the in-process runner, worker RSS, and kill -9 recovery time."""
    from vlmbatch.bench.queue import run

    run(rows, shard_size, workers, broker, json_out, dict(os.environ))


def register(bench_app: typer.Typer) -> None:
    bench_app.command("queue")(queue)
