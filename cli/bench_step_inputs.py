"""`vlmbatch bench step-inputs`: host time to build a prefill step's inputs beside decoding rows."""

from __future__ import annotations

from pathlib import Path

import typer

from vlmbatch.cli.bench_options import model_shape_option, shape_or_exit


def bench_step_inputs(
    shape: str = model_shape_option("tiny"),
    rows: int = typer.Option(440, "--rows", min=1, help="Decoding sequences riding along in the prefill step."),
    repeats: int = typer.Option(20, "--repeats", min=1, help="Timed builds of the step's inputs (the median is reported)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N."),
    json_out: Path = typer.Option(Path("bench-out/step-inputs.json"), "--json", help="Where to write the figures."),
) -> None:
    """Milliseconds of host time to build the inputs of one prefill step carrying ROWS decoding sequences."""
    from vlmbatch.bench.step_inputs import run

    run(shape_or_exit(shape).name, rows, repeats, device, json_out)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("step-inputs")(bench_step_inputs)
