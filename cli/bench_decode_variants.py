"""`vlmbatch bench decode-variants`: decode-step time with programmatic dependent launch up to each batch size."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import int_list, shape_or_exit, split


def bench_decode_variants(
    shapes: str = typer.Option("qwen2_5_vl_3b,qwen2_5_vl_7b", "--shapes", help="Model shapes with random weights (as --model-shape; tiny: a CPU smoke run)."),
    batches: str = typer.Option("1,16,64", "--batches", help="Decode batch sizes to time."),
    pdl_max_batches: str = typer.Option("0,16,512", "--pdl-max-batches", help="Largest batch launched with PDL, per variant (0 = never); the first is the reference."),
    agree_requests: int = typer.Option(8, "--agree-requests", min=1, help="W1 requests whose greedy tokens every variant must reproduce."),
    device: str = typer.Option("cuda", "--device", help="cuda, cuda:N, or cpu (a smoke run: tiny shape, TRITON_INTERPRET=1)."),
    json_out: Path = typer.Option(Path("bench-out/decode_variants.json"), "--json", help="Where to write the figures."),
) -> None:
    """Each variant's decode step against the roofline; exits 1 when a variant's tokens differ from the first's."""
    from vlmbatch.bench.variants import run

    pdl = [int(b) for b in split(pdl_max_batches)]
    names = [shape_or_exit(s).name for s in split(shapes)]
    if not run(names, list(int_list(batches, "--batches")), pdl, agree_requests, device, json_out):
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("decode-variants")(bench_decode_variants)
