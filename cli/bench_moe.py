"""`vlmbatch bench moe`: sweep the fused-MoE kernel's tiles per token count on the GPU."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import int_list


def bench_moe(
    json_out: Path = typer.Option(Path("moe_sweep.json"), "--json", help="Where to write every candidate's timing."),
    tokens: str = typer.Option("1,2,4,8,16,32,64,128,256,512,1024,4096,16384", help="Token counts to sweep, comma-separated."),
    layers: int = typer.Option(4, min=1, help="Distinct expert weight sets per timing, so each call reads from memory, not L2."),
    write_table: bool = typer.Option(False, "--write-table", help="Write the winners into the fused MoE's tuned table (kernels/fused_moe_tuned.json)."),
    experts: str = typer.Option("bf16", "--experts", help="Expert weights: bf16, or fp8-block (e4m3 with 128x128 block scales, "
                                "as Qwen's -FP8 checkpoints; its own table entry)."),
) -> None:
    """Time every candidate tile of the fused MoE per token count; the engine's table comes from this.

    The Qwen3-VL-30B-A3B expert shape with bf16 activations and bf16 or block-FP8 experts
    (`--experts`); the fastest per token count is printed as a share of copy bandwidth."""
    import torch

    from vlmbatch.bench.moe import EXPERT_FORMATS

    if experts not in EXPERT_FORMATS:
        typer.echo(f"--experts must be one of {', '.join(EXPERT_FORMATS)}, not {experts!r}", err=True)
        raise typer.Exit(2)
    if not torch.cuda.is_available():
        typer.echo("vlmbatch bench moe needs a CUDA GPU", err=True)
        raise typer.Exit(2)
    from vlmbatch.bench.moe import format_sweep, sweep_moe, write_tuned_table
    result = sweep_moe(token_counts=int_list(tokens, "--tokens"), layers=layers, json_path=json_out, echo=typer.echo, experts=experts)
    typer.echo(format_sweep(result))
    if write_table:
        typer.echo(f"wrote {write_tuned_table(result)}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("moe")(bench_moe)
