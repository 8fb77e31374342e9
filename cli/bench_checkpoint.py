"""`vlmbatch bench make-checkpoint`: a benchmark shape's random weights on disk in the published layout, shard by shard."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import shape_or_exit


def bench_make_checkpoint(
    directory: Path = typer.Argument(..., help="The model folder goes to DIRECTORY/<shape>."),
    model_shape: str = typer.Option("qwen2_5_vl_72b", "--model-shape", help="A `bench engine` shape (published sizes)."),
    quantization: str = typer.Option("none", "--quantization", help="none (bf16), fp8-block (Qwen's -FP8 layout) or "
                                     "fp8-dynamic (compressed-tensors, llm-compressor's -FP8-dynamic layout)."),
    shard_mib: int = typer.Option(4096, "--shard-mib", min=1, help="Largest shard in MiB (a larger single tensor gets one alone)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    overflow: list[Path] = typer.Option([], "--overflow", metavar="DIR", help="A directory on another filesystem (e.g. /dev/shm) for the "
                                        "shards DIRECTORY's has no room for, linked from the model folder; repeatable."),
) -> None:
    """Write a shape's random weights as a checkpoint, shard by shard, without building the model.

    Host memory holds one shard, so Qwen2.5-VL-72B in FP8 (~77 GB) is written on a GPU machine
    and then loaded by `bench engine --model DIR/<shape> --no-reference`. A checkpoint
    larger than the disk spills into `--overflow` directories; one that cannot fit even so
    is refused before anything is written."""
    from vlmbatch.bench.checkpoint import QUANTIZATIONS, write_random_checkpoint

    if quantization not in QUANTIZATIONS:
        raise typer.BadParameter(f"choose one of {', '.join(QUANTIZATIONS)}", param_hint="--quantization")
    try:
        folder = write_random_checkpoint(shape_or_exit(model_shape), directory, quantization, shard_bytes=shard_mib << 20,
                                         seed=seed, overflow=overflow, echo=typer.echo)
    except OSError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {folder}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("make-checkpoint")(bench_make_checkpoint)
