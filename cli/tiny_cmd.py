"""`vlmbatch make-tiny-model`: write a tiny random-weight checkpoint for demos and tests."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from vlmbatch.families.registry import FAMILIES

TinyArch = Enum("TinyArch", {name: name for name in FAMILIES}, type=str)  # one choice per registered family


def make_tiny_model_command(
    directory: Path = typer.Argument(..., metavar="DIR", help="Folder to write the checkpoint into (created if missing)."),
    arch: TinyArch = typer.Option(TinyArch("qwen2_5_vl"), "--arch", help="Model family to imitate."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; the same seed gives byte-identical weights."),
    quantization: Optional[str] = typer.Option(
        None, "--quantization",
        help="Write the language model in a published FP8 layout: fp8-block (Qwen's -FP8: 128x128 blocks, weight_scale_inv) "
        "or fp8-dynamic (compressed-tensors -FP8-dynamic: per channel, weight_scale).",
    ),
) -> None:
    """Write a tiny random-weight checkpoint in Hugging Face layout that `--model DIR` accepts.

    Config, safetensors, tokenizer, processor and chat template, as a real model has. Its
    output is gibberish: it exists to exercise the pipeline without downloading a model."""
    from vlmbatch.testing.tiny import make_tiny_model

    from vlmbatch.testing.fp8_checkpoints import FORMATS, quantize_checkpoint

    if quantization is not None and quantization not in FORMATS:
        raise typer.BadParameter(f"choose one of {', '.join(FORMATS)}", param_hint="--quantization")
    path = make_tiny_model(directory, arch.value, seed=seed)
    if quantization is not None:
        quantize_checkpoint(path, quantization)
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("make-tiny-model")(make_tiny_model_command)
