"""The `vlmbatch` command line: a thin Typer layer over the library.

Each command group lives in its own module and registers itself on the app that
`commands.py` builds, so the modules stay small and import their heavy dependencies only
when they run.
"""

from __future__ import annotations

import os


def main() -> None:
    # Every Python process vlmbatch starts (workers, the server, benchmark children) leaves
    # its working directory off sys.path: started from a checkout's root, the top-level
    # kernels/ folder (installed as vlmbatch.kernels) would otherwise shadow Hugging Face's
    # `kernels` package, which transformers >= 5.25 imports. Ignored before Python 3.11.
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    from vlmbatch.cli.commands import app

    app()
