"""`vlmbatch bench tower`: our vision tower against transformers' on the same random weights and W1 images."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit, split


def bench_tower(
    shape: str = model_shape_option("qwen3_vl_8b"),
    images: int = typer.Option(64, "--images", min=1, help="W1 images (448x448) in the one batch both towers encode."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when there is one), cuda, cuda:N or cpu."),
    json_out: Path = typer.Option(Path("bench-out/tower.json"), "--json", help="Where to write the figures."),
    profile: bool = typer.Option(False, "--profile", help="Also one profiled call of each tower: its top kernels by device "
                                                          "time (CPU ops on the CPU), printed and in the JSON."),
    sdpa_backends: str = typer.Option("", "--sdpa-backends", help="Also time ours with PyTorch's SDPA held to each of these "
                                      "backends, comma-separated: flash, cudnn, efficient, math."),
    quantize_vision: bool = typer.Option(False, "--quantize-vision", help="Also time ours with its linear layers in FP8, as "
                                         "`--quantization fp8 --quantize-vision` runs the tower (FP8 GEMMs need a GPU of SM 8.9+)."),
) -> None:
    """ms per image, TFLOP/s and relative error of our vision tower against transformers'.

    For shapes whose family has a tower of ours (qwen2_5_vl, qwen3_vl, qwen3_vl_moe;
    SigLIP: gemma3, llava_onevision, idefics3, smolvlm)."""
    from vlmbatch.bench.shapes import ShapeError
    from vlmbatch.bench.tower import SDPA_BACKENDS, check_shape, run
    from vlmbatch.engine.loading import resolve_device

    model_shape = shape_or_exit(shape)
    try:
        check_shape(model_shape)
    except ShapeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    backends = split(sdpa_backends)
    unknown = [b for b in backends if b not in SDPA_BACKENDS]
    if unknown:
        raise typer.BadParameter(f"unknown {', '.join(unknown)}; choose from {', '.join(SDPA_BACKENDS)}", param_hint="--sdpa-backends")
    run(model_shape, images, resolve_device(device), json_out, profile, backends, quantize_vision)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("tower")(bench_tower)
