"""`vlmbatch results`: summarise, merge or list the errors of a job's committed parts."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from vlmbatch.cli.options import BrokerOption, OutputOption, StorageOptionsOption, parse_json_option, resolve_job_dir


def results(
    job: str = typer.Argument(..., help="Job id (under --output, or through the broker) or the job's folder (a path or an s3:// URL)."),
    output: str = OutputOption,
    broker: Optional[str] = BrokerOption,
    merge: Optional[str] = typer.Option(None, "--merge", help="Write one Parquet file ordered by row_id (streamed, memory bounded; a path or a URL)."),
    errors_only: bool = typer.Option(False, "--errors-only", help="Only rows that ended in an error (with --merge: only those are written)."),
    partial: bool = typer.Option(False, "--partial", help="Accept a job whose parts are not all committed yet."),
    storage_options: Optional[str] = StorageOptionsOption,
) -> None:
    """Summarise a job's results, or merge them into one file."""
    from vlmbatch.io.results import merge as merge_parts, summarize
    from vlmbatch.job.report import print_errors, print_summary

    console = Console()
    options = parse_json_option(storage_options, "--storage-options")
    job_dir = resolve_job_dir(job, output, options, broker)
    summary = summarize(job_dir)
    if summary.parts_committed < summary.parts_planned and not partial:
        Console(stderr=True).print(
            f"[red]error:[/red] job {job_dir.name} is incomplete ({summary.parts_committed}/{summary.parts_planned} parts); "
            "wait for it, `vlmbatch resume` it, or pass --partial"
        )
        raise typer.Exit(1)
    if merge is not None:
        rows = merge_parts(job_dir, merge, errors_only=errors_only, storage_options=options)
        console.print(f"wrote {rows:,} rows to {merge}")
        return
    if errors_only:
        print_errors(job_dir, console)
        return
    print_summary(job_dir, console)


def register(app: typer.Typer) -> None:
    app.command()(results)
