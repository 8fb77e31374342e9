"""The `vlmbatch` command line: a thin Typer layer over the library.

Each command group lives in its own module and registers itself here, so the
modules stay small and import their heavy dependencies only when they run.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="vlmbatch",
    help="Batch-offline inference for vision-language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def main() -> None:
    from vlmbatch.cli import commands  # noqa: F401  (registers the commands on `app`)

    app()
