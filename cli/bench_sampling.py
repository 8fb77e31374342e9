"""`vlmbatch bench sampling`: penalties, logprobs and n > 1 against plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import shape_or_exit


def bench_sampling(
    shape: str = typer.Option("qwen2_5_vl_3b", "--shape", help="Model shape with random weights (tiny: a CPU smoke run)."),
    requests: int = typer.Option(256, "--requests", min=4, help="W1 requests per variant (n = 4: a quarter of them)."),
    output_tokens: int = typer.Option(128, "--output-tokens", min=1, help="Tokens forced per request."),
    device: str = typer.Option("cuda", "--device", help="cuda, cuda:N or cpu."),
    json_out: Path = typer.Option(Path("bench-out/sampling.json"), "--json", help="Where to write the figures."),
) -> None:
    """Output tokens/s per sampling variant and its ratio to greedy; exits 1 when neutral adjustments change a token."""
    from vlmbatch.bench.sampling import run

    if not run(shape_or_exit(shape).name, requests, output_tokens, device, json_out):
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("sampling")(bench_sampling)
