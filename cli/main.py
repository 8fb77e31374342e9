"""The `vlmbatch` command line: a thin Typer layer over the library.

Each command group lives in its own module and registers itself on the app that
`commands.py` builds, so the modules stay small and import their heavy dependencies only
when they run.
"""

from __future__ import annotations


def main() -> None:
    from vlmbatch.cli.commands import app

    app()
