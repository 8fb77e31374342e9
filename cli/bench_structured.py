"""`vlmbatch bench structured`: grammar libraries (xgrammar, llguidance) compared on a locally
built Qwen-size vocabulary: tokenizer set-up, compile, and mask fill per step per batch size."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def bench_structured(
    vocab_size: int = typer.Option(151_936, "--vocab-size", min=1000, help="Tokens of the byte-level BPE built for the run."),
    batches: str = typer.Option("64,256", "--batches", help="Batch sizes, comma-separated."),
    steps: int = typer.Option(50, "--steps", min=1, help="Decode steps timed per path and batch size."),
    threads: str = typer.Option("2", "--threads", help="Thread counts for the parallel fills, comma-separated."),
    output: Path = typer.Option(Path("bench-out/structured.json"), "--output", "-o", help="JSON results file."),
) -> None:
    """Compile time and per-step mask fill time of xgrammar and llguidance (and, on CUDA, the mask kernel)."""
    from vlmbatch.bench.structured import run_structured_bench

    report = run_structured_bench(vocab_size, [int(b) for b in batches.split(",")], steps, [int(t) for t in threads.split(",")], typer.echo)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    typer.echo(f"wrote {output}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("structured")(bench_structured)
