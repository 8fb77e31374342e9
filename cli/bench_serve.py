"""`vlmbatch bench serve`: requests/s and p50/p99 latency of `vlmbatch serve` at several
numbers of concurrent clients; prints a table and writes JSON (see BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit
from vlmbatch.cli.options import EngineOption


def bench_serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Start `vlmbatch serve` with this model for the run."),
    shape: Optional[str] = model_shape_option(None),
    url: Optional[str] = typer.Option(None, "--url", help="Measure an already running server instead (e.g. http://127.0.0.1:2242)."),
    engine: str = EngineOption,
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VLMBATCH_API_KEY", help="Bearer key of the server."),
    concurrency: str = typer.Option("1,16,200", "--concurrency", help="Comma-separated numbers of concurrent clients."),
    requests_per_level: int = typer.Option(0, "--requests", help="Requests per level (default: max(32, 2 x clients))."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Tokens generated per request."),
    image_side: int = typer.Option(64, "--image-side", min=0, help="Side of the PNG sent with each request; 0 sends text only."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream every other request."),
    output: Path = typer.Option(Path("bench-out/serve.json"), "--output", "-o", help="JSON results file."),
) -> None:
    """Closed-loop load: each client sends its next request when the previous one is answered (--model-shape: random weights written under --output's folder)."""
    from vlmbatch.bench.serve import run

    if sum(x is not None for x in (model, shape, url)) != 1:
        raise typer.BadParameter("give exactly one of --model or --shape (start a server) and --url (use a running one)")
    if shape is not None:
        shape_or_exit(shape)
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    run(model, shape, url, engine, api_key, levels, requests_per_level, max_tokens, image_side, stream, output)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("serve")(bench_serve)
