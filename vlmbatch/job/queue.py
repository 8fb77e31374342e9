"""The client side of the queue: enqueue a planned job, then status, wait, cancel, resume.

The manifest plus the committed parts in the output folder are the truth; Redis holds
the queue and advisory progress. So "done" always means "its part exists", and `resume`
rebuilds what Redis lost (counters, queued messages) from the folder alone.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmbatch.io.manifest import Manifest
from vlmbatch.io.storage import Location
from vlmbatch.job.parts import committed_shards, part_counts, pending_shards

if TYPE_CHECKING:
    from rich.console import Console

    from vlmbatch.workers.store import JobStore

# Job states that `wait` stops at, with its exit code for each.
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3, "lost": 4}


@dataclass
class JobStatus:
    job_id: str
    state: str  # queued | running | completed | cancelling | cancelled | failed | lost
    num_rows: int | None  # None: JSONL on object storage, counted as its shards are read
    rows_ok: int
    rows_failed: int
    num_shards: int
    shards: Counter[str] = field(default_factory=Counter)  # shard state -> count
    workers: list[str] = field(default_factory=list)
    rows_per_s: float | None = None
    eta_s: float | None = None
    errors: list[str] = field(default_factory=list)  # why shards failed

    @property
    def rows_done(self) -> int:
        return self.rows_ok + self.rows_failed


def _store(manifest: Manifest, broker_url: str) -> JobStore:
    from vlmbatch.workers.store import JobStore, connect

    return JobStore(connect(broker_url), manifest.job_id)


def _queue_shards(manifest: Manifest, broker_url: str, shard_ids: list[int], retry_errors: bool = False) -> None:
    from vlmbatch.config import QueueConfig
    from vlmbatch.workers.app import SHARD_TASK, make_app, queue_name

    app = make_app(broker_url, QueueConfig())  # it only sends: the delivery settings are the workers'
    queue = queue_name(manifest.model)
    with app.producer_or_acquire() as producer:
        for shard_id in shard_ids:
            app.send_task(SHARD_TASK, args=[str(manifest.job_dir), shard_id, retry_errors], queue=queue, producer=producer)


def recorded_job_dir(job_id: str, broker_url: str) -> str | None:
    """The folder (path or URL) that `submit` recorded in Redis for `job_id`, or None."""
    from vlmbatch.workers.store import JobStore, connect

    return JobStore(connect(broker_url), job_id).job_dir()


def enqueue_job(manifest: Manifest, job_dir: Location, broker_url: str) -> int:
    """Queue one task per shard without a committed part on the model's queue; returns how many."""
    from vlmbatch.workers.app import queue_name

    store = _store(manifest, broker_url)
    store.register(str(job_dir), manifest.model, queue_name(manifest.model), manifest.num_shards, manifest.num_rows)
    pending = pending_shards(manifest, job_dir)
    store.set_shard_states(pending, "queued")
    _queue_shards(manifest, broker_url, pending)
    return len(pending)


def job_status(job_dir: Location, broker_url: str) -> JobStatus:
    """Where the job stands: parts from the folder, the rest from Redis."""
    manifest = Manifest.load(job_dir)
    store = _store(manifest, broker_url)
    committed = committed_shards(manifest)
    recorded = store.shard_states()
    holders = store.lease_holders([s.shard_id for s in manifest.shards])
    ok_by_shard, failed_by_shard = store.rows_by_shard()
    shards: Counter[str] = Counter()
    errors = []
    for plan in manifest.shards:
        shard_id = plan.shard_id
        record = recorded.get(shard_id, {})
        if shard_id in committed:
            state = _committed_state(record.get("state"), shard_id in holders)
            if record.get("state") != "done":  # Redis missed the commit, or a retry is under way
                ok_by_shard[shard_id], failed_by_shard[shard_id] = part_counts(manifest.part_path(shard_id))
        elif shard_id in holders:
            state = "running"
        else:
            state = record.get("state", "queued")
            if state == "running":
                state = "queued"  # its worker died; the message is on its way back
        shards[state] += 1
        if state == "failed":
            errors.append(f"shard {shard_id}: {record.get('error', 'unknown error')}")

    status = JobStatus(
        job_id=manifest.job_id,
        state=_job_state(manifest.num_shards, shards, store.is_cancelled(), store.is_registered()),
        num_rows=manifest.num_rows,
        rows_ok=sum(ok_by_shard.values()),
        rows_failed=sum(failed_by_shard.values()),
        num_shards=manifest.num_shards,
        shards=shards,
        workers=sorted(set(holders.values())),
        errors=errors,
    )
    started = store.started_at()
    if started is not None and status.rows_done and status.state in ("running", "queued"):
        status.rows_per_s = status.rows_done / max(time.time() - started, 1e-6)
        if status.num_rows is not None:
            status.eta_s = (status.num_rows - status.rows_done) / status.rows_per_s
    return status


def _committed_state(recorded: str | None, leased: bool) -> str:
    """A committed shard is `retrying` while `resume --retry-errors` re-runs its error rows."""
    if recorded == "retrying" or (recorded == "running" and leased):
        return "retrying"
    return "done"


def _job_state(num_shards: int, shards: Counter[str], cancelled: bool, registered: bool) -> str:
    if shards["done"] == num_shards:
        return "completed"
    if not registered:
        return "lost"  # Redis lost the job (flushed, replaced): only `resume` brings it back
    if cancelled:
        return "cancelling" if shards["running"] or shards["retrying"] else "cancelled"
    if shards["failed"] and not (shards["running"] or shards["queued"] or shards["retrying"]):
        return "failed"
    return "queued" if shards["queued"] == num_shards else "running"


def cancel_job(job_dir: Location, broker_url: str) -> None:
    """No new shard starts; running shards stop at their next step without committing."""
    manifest = Manifest.load(job_dir)
    _store(manifest, broker_url).cancel()


def resume_job(job_dir: Location, broker_url: str, retry_errors: bool = False) -> int:
    """Re-queue every shard without a committed part (and, with `retry_errors`, every part
    holding error rows, to re-run just those rows); rebuilds Redis state from the folder."""
    from vlmbatch.workers.app import queue_name

    manifest = Manifest.load(job_dir)
    store = _store(manifest, broker_url)
    store.clear_cancel()
    store.register(str(manifest.job_dir), manifest.model, queue_name(manifest.model), manifest.num_shards, manifest.num_rows)
    committed = committed_shards(manifest)
    with_errors = []
    for shard_id in sorted(committed):
        ok, failed = part_counts(manifest.part_path(shard_id))
        store.set_rows(shard_id, ok, failed)
        if failed:
            with_errors.append(shard_id)
    pending = pending_shards(manifest, manifest.job_dir)
    store.set_shard_states(pending, "queued")
    _queue_shards(manifest, broker_url, pending)
    if retry_errors:
        store.set_shard_states(with_errors, "retrying")
        _queue_shards(manifest, broker_url, with_errors, retry_errors=True)
        return len(pending) + len(with_errors)
    return len(pending)


def follow_job(job_dir: Location, broker_url: str, console: Console | None = None, poll_s: float = 1.0) -> int:
    """Show a progress bar until the job ends; the exit code says how it ended."""
    import redis
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = None
        while True:
            try:
                status = job_status(job_dir, broker_url)
            except redis.RedisError as exc:
                progress.console.print(f"[yellow]broker unreachable, retrying: {exc}")
                time.sleep(poll_s)
                continue
            if bar is None:
                bar = progress.add_task(status.job_id, total=status.num_rows, info="")
            progress.update(bar, completed=status.rows_done, info=describe(status))
            if status.state in EXIT_CODES:
                break
            time.sleep(poll_s)
    for error in status.errors:
        console.print(f"[red]{error}")
    if status.state == "lost":
        console.print(f"[red]the broker has no record of this job (Redis restarted empty?): run `vlmbatch resume {status.job_id}`")
    console.print(f"job {status.job_id} {status.state}: {status.rows_ok} rows ok, {status.rows_failed} failed")
    return EXIT_CODES[status.state]


def describe(status: JobStatus) -> str:
    """One line: state, failed rows, shards by state, speed."""
    shards = ", ".join(f"{n} {state}" for state, n in sorted(status.shards.items()) if n)
    speed = f", {status.rows_per_s:,.1f} rows/s" if status.rows_per_s else ""
    return f"{status.state}: {status.rows_failed} failed rows; shards {shards}{speed}"


def status_table(status: JobStatus) -> Any:
    """The `vlmbatch status` view as a rich table."""
    from rich.table import Table

    table = Table(title=f"job {status.job_id}", show_header=False)
    eta = f"{status.eta_s:,.0f} s" if status.eta_s is not None else "-"
    rate = f"{status.rows_per_s:,.1f}" if status.rows_per_s is not None else "-"
    for name, value in [
        ("state", status.state),
        ("rows done", f"{status.rows_done:,} / {'?' if status.num_rows is None else format(status.num_rows, ',')}"),
        ("rows failed", f"{status.rows_failed:,}"),
        ("shards", ", ".join(f"{state} {n}" for state, n in sorted(status.shards.items()) if n)),
        ("rows/s", rate),
        ("ETA", eta),
        ("workers", ", ".join(status.workers) or "-"),
    ]:
        table.add_row(name, value)
    for error in status.errors:
        table.add_row("error", error)
    return table
