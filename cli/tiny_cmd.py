"""`vlmbatch make-tiny-model`: write a tiny random-weight checkpoint for demos and tests."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from vlmbatch.families.registry import FAMILIES

TinyArch = Enum("TinyArch", {name: name for name in FAMILIES}, type=str)  # one choice per registered family


def make_tiny_model_command(
    directory: Path = typer.Argument(..., metavar="DIR", help="Folder to write the checkpoint into (created if missing)."),
    arch: TinyArch = typer.Option(TinyArch("qwen2_5_vl"), "--arch", help="Model family to imitate."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; the same seed gives byte-identical weights."),
) -> None:
    """Write a tiny random-weight checkpoint in Hugging Face layout (config, safetensors,
    tokenizer, processor, chat template) that `--model DIR` accepts. Its output is
    gibberish: it exists to exercise the pipeline without downloading a real model."""
    from vlmbatch.testing.tiny import make_tiny_model

    path = make_tiny_model(directory, arch.value, seed=seed)
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("make-tiny-model")(make_tiny_model_command)
