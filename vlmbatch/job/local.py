"""The embedded default: run every pending shard of a job in this process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vlmbatch.job.parts import committed_shards, part_counts, pending_shards
from vlmbatch.job.preparer import RowPreparer
from vlmbatch.job.shard import run_shard

# `Manifest.extra` key: the engine flags `submit` ran an in-process job with, so that
# `resume` loads the model the same way (a queued job's workers bring their own).
ENGINE_FLAGS_KEY = "engine_flags"


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
                    show_progress: bool = True, console: Console | None = None, retry_errors: bool = False) -> float:
    """Run the job's pending shards one after another, with a rich progress bar; return
    seconds taken. `preparer` is the caller's preprocessing pool, for all the job's shards
    (a caller that runs several jobs on one engine keeps it warm, as a worker does).
    `retry_errors`: also re-run the error rows of the committed parts that have some."""
    started = time.perf_counter()
    todo = pending_shards(manifest, job_dir)
    retried: dict[int, int] = {}  # committed shard -> its error rows, re-run with `retry_errors`
    if retry_errors:
        failed_rows = {shard_id: part_counts(manifest.part_path(shard_id))[1] for shard_id in sorted(committed_shards(manifest))}
        retried = {shard_id: failed for shard_id, failed in failed_rows.items() if failed}
    done_rows = sum(s.num_rows or 0 for s in manifest.shards if s.shard_id not in set(todo))  # None: not counted yet
    done_rows -= sum(retried.values())
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
        for shard_id in retried:
            run_shard(manifest, job_dir, shard_id, llm, preparer=preparer, on_progress=advance, retry_errors=True)
    return time.perf_counter() - started


def run_in_process(manifest: Any, job_dir: Path, config: Any, worker: Any, media: Any, *,
                   console: Console | None = None, retry_errors: bool = False) -> float:
    """The embedded default of `submit` and `resume`: load the job's model here (its chat
    template from the manifest) and run what is left of the job; returns seconds taken.
    A job the engine cannot run as configured (GPU image decoding forced on without CUDA)
    raises `JobError` before any row runs."""
    from vlmbatch.engine.gpu_images import defers_image_decoding
    from vlmbatch.job.plan import load_llm

    with RowPreparer(worker, media) as preparer:  # one preprocessing pool for all the job's shards
        preparer.start_fork_server()  # its imports overlap the model load
        llm = load_llm(manifest.model, config, chat_template=manifest.extra.get("chat_template"))
        defers_image_decoding(llm.engine, manifest.extra.get("gpu_image_decode") or config.gpu_image_decode)
        return run_job_locally(manifest, job_dir, llm, preparer, console=console, retry_errors=retry_errors)


def _rate(progress: Progress, task_id: Any) -> str:
    task = progress.tasks[task_id]
    speed = task.speed
    return f"{speed:,.1f} rows/s" if speed else ""
