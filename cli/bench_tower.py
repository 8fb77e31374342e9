"""`vlmbatch bench tower`: our vision tower against transformers' on the same random weights and W1 images."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit


def bench_tower(
    shape: str = model_shape_option("qwen3_vl_8b"),
    images: int = typer.Option(64, "--images", min=1, help="W1 images (448x448) in the one batch both towers encode."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when there is one), cuda, cuda:N or cpu."),
    json_out: Path = typer.Option(Path("bench-out/tower.json"), "--json", help="Where to write the figures."),
    profile: bool = typer.Option(False, "--profile", help="Also one profiled call of each tower: its top kernels by device "
                                                          "time (CPU ops on the CPU), printed and in the JSON."),
) -> None:
    """ms per image, TFLOP/s and the relative error of our vision tower and transformers', for
    shapes whose family has a tower of ours (qwen2_5_vl, qwen3_vl, qwen3_vl_moe; SigLIP:
    gemma3, llava_onevision, idefics3, smolvlm)."""
    from vlmbatch.bench.shapes import ShapeError
    from vlmbatch.bench.tower import check_shape, run
    from vlmbatch.engine.loading import resolve_device

    model_shape = shape_or_exit(shape)
    try:
        check_shape(model_shape)
    except ShapeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    run(model_shape, images, resolve_device(device), json_out, profile)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("tower")(bench_tower)
