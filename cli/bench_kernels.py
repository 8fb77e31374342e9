"""`vlmbatch bench kernels`: check the Triton kernels against their references and time them on the GPU."""

from __future__ import annotations

from pathlib import Path

import typer


def bench_kernels(
    json_out: Path = typer.Option(Path("bench-out/kernels.json"), "--json", help="Where to write the figures."),
    config_sweep: bool = typer.Option(True, help="Also sweep launch configs (block sizes, warps, stages)."),
    sections: str = typer.Option("prefill,decode,linear", help="What to time, comma-separated: prefill, decode, linear, fp8."),
    write_table: bool = typer.Option(False, "--write-table", help="Write the prefill sweep's fastest launch per prompt length "
                                     "into kernels/prefill_tuned.json, which the engine's prefill attention reads."),
) -> None:
    """Check every kernel in bf16/fp16, then time them against SDPA and cuBLAS.

    Prefill and decode attention against SDPA, the decode-step linear layers against
    cuBLAS, each next to the GPU's measured ceilings."""
    import torch

    if not torch.cuda.is_available():
        typer.echo("vlmbatch bench kernels needs a CUDA GPU", err=True)
        raise typer.Exit(2)
    from vlmbatch.bench.kernels import run_kernel_bench

    report = run_kernel_bench(json_out, sweep_configs=config_sweep, echo=typer.echo, sections=tuple(sections.split(",")),
                              write_table=write_table)
    if not report.ok:
        raise typer.Exit(1)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("kernels")(bench_kernels)
