"""Human-readable reports: the end-of-job summary and the dry-run findings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_summary(job_dir: Path, console: Console, elapsed_s: float | None = None) -> Any:
    """Print rows, errors by type, tokens and speed of a job from its committed parts."""
    from vlmbatch.io.results import summarize

    summary = summarize(job_dir)
    table = Table(title=f"job {job_dir.name}", show_header=False)
    table.add_row("results", str(job_dir / "results"))
    table.add_row("parts", f"{summary.parts_committed}/{summary.parts_planned}")
    table.add_row("rows", f"{summary.rows:,} ({summary.rows_ok:,} ok, {summary.rows_failed:,} failed)")
    for error_type, count in sorted(summary.errors_by_type.items()):
        table.add_row(f"  {error_type}", f"{count:,}")
    table.add_row("tokens", f"{summary.input_tokens:,} in, {summary.output_tokens:,} out")
    if elapsed_s:
        table.add_row("time", f"{elapsed_s:,.1f} s ({summary.rows / elapsed_s:,.1f} rows/s)")
    console.print(table)
    return summary


def print_dry_run(report: Any, console: Console, examples: int = 10) -> None:
    table = Table(title=f"dry run of {report.dataset}", show_header=False)
    table.add_row("rows", f"{report.rows:,} ({report.rows_failed:,} would fail)")
    for error_type, count in sorted(report.errors_by_type.items()):
        table.add_row(f"  {error_type}", f"{count:,}")
    table.add_row("time", f"{report.elapsed_s:,.2f} s ({report.rows_per_s:,.0f} rows/s after {report.startup_s:.1f} s start-up)")
    console.print(table)
    for row_id, error_type, message in report.examples[:examples]:
        console.print(f"  row {row_id}: [red]{error_type}[/red] {message}")


def print_errors(job_dir: Path, console: Console, limit: int = 50) -> None:
    """The rows that ended in an error: row id, id, type and message."""
    from vlmbatch.io.results import iter_errors

    table = Table("row_id", "id", "error_type", "error", title=f"errors of job {job_dir.name}")
    shown = total = 0
    for row in iter_errors(job_dir):
        total += 1
        if shown < limit:
            key = row.get("id", row.get("custom_id"))
            table.add_row(str(row["row_id"]), str(key), row["error_type"], row["error"])
            shown += 1
    console.print(table)
    if total > shown:
        console.print(f"... and {total - shown:,} more (use --merge FILE --errors-only for all)")
