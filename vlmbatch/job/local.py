"""The embedded default: run every pending shard of a job in this process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vlmbatch.job.parts import pending_shards
from vlmbatch.job.preparer import RowPreparer
from vlmbatch.job.shard import run_shard


def job_progress(console: Console | None = None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows  [red]{task.fields[failed]} failed"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def run_job_locally(manifest: Any, job_dir: Path, llm: Any, preparer: RowPreparer, *,
                    show_progress: bool = True, console: Console | None = None) -> float:
    """Run the job's pending shards one after another, with a rich progress bar; return
    seconds taken. `preparer` is the caller's preprocessing pool, for all the job's shards
    (a caller that runs several jobs on one engine keeps it warm, as a worker does)."""
    started = time.perf_counter()
    todo = pending_shards(manifest, job_dir)
    done_rows = sum(s.num_rows or 0 for s in manifest.shards if s.shard_id not in set(todo))  # None: not counted yet
    with job_progress(console) as progress:
        task = progress.add_task(manifest.job_id, total=manifest.num_rows, completed=done_rows, failed=0, rate="")
        if not show_progress:
            progress.stop()
        failed = 0

        def advance(ok: int, bad: int) -> None:
            nonlocal failed
            failed += bad
            progress.update(task, advance=ok + bad, failed=failed, rate=_rate(progress, task))

        for shard_id in todo:
            run_shard(manifest, job_dir, shard_id, llm, preparer=preparer, on_progress=advance)
    return time.perf_counter() - started


def _rate(progress: Progress, task_id: Any) -> str:
    task = progress.tasks[task_id]
    speed = task.speed
    return f"{speed:,.1f} rows/s" if speed else ""
