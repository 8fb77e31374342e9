"""Running a shard so that a row which kills its process cannot block the job forever.

Every attempt at a row range is counted in the job's crash ledger until it ends; an
attempt that never ends took its process down. A shard whose range has crashed
`crash_limit` times is run in `SPLIT_PARTS` sub-ranges, each with its own count, and so on
down to single rows: a single row that crashed `crash_limit` times is written as a
`worker_crash` error row, and the rest of the shard is generated normally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.storage import Location
from vlmbatch.job.preparer import RowPreparer
from vlmbatch.job.shard import ShardOutcome, run_shard
from vlmbatch.workers.store import JobStore, RowRange

# Splitting into quarters isolates a row in log4(shard size) levels: fewer crash rounds
# than halving (log2), and each round costs a process restart plus a visibility timeout.
SPLIT_PARTS = 4


class ShardStopped(Exception):
    """The shard stopped early (cancel, shutdown, lease lost): nothing was committed."""


def split(rows: RowRange, parts: int = SPLIT_PARTS) -> list[RowRange]:
    """Up to `parts` contiguous, non-empty sub-ranges covering `rows`."""
    size = -(-len(rows) // parts)
    return [RowRange(s, min(s + size, rows.end)) for s in range(rows.start, rows.end, size)]


def run_guarded(
    manifest: Manifest,
    job_dir: Location,
    shard_id: int,
    llm: Any | None,
    store: JobStore,
    crash_limit: int,
    *,
    attempt: int,
    should_stop: Callable[[], bool],
    on_progress: Callable[[int, int], None],
    preparer: RowPreparer,
    **shard_options: Any,
) -> ShardOutcome:
    """Run and commit shard `shard_id`, isolating rows that crashed earlier attempts;
    `shard_options` go to every `run_shard` call as they are."""
    plan = manifest.shards[shard_id]
    whole = RowRange(plan.row_start, plan.row_end)
    options = {"attempt": attempt, "should_stop": should_stop, "on_progress": on_progress, "preparer": preparer,
               **shard_options}
    if store.crashes(whole) < crash_limit:
        with store.attempt(whole):
            outcome = run_shard(manifest, job_dir, shard_id, llm, **options)
        if outcome.stopped:
            raise ShardStopped
        return outcome

    def run_range(rows: RowRange) -> list[dict[str, Any]]:
        if store.crashes(rows) < crash_limit:
            with store.attempt(rows):
                outcome = run_shard(
                    manifest, job_dir, shard_id, llm, row_range=(rows.start, rows.end), commit=False, **options
                )
            if outcome.stopped:
                raise ShardStopped
            return outcome.rows
        if len(rows) == 1:
            on_progress(0, 1)
            return [crash_row(manifest, shard_id, rows.start, attempt, store.crashes(rows))]
        return [row for sub in split(rows) for row in run_range(sub)]

    from vlmbatch.io.writer import write_part

    result_rows = sorted((row for sub in split(whole) for row in run_range(sub)), key=lambda r: r["row_id"])
    outcome = ShardOutcome(shard_id=shard_id)
    outcome.rows_failed = sum(1 for row in result_rows if row["error_type"] is not None)
    outcome.rows_ok = len(result_rows) - outcome.rows_failed
    outcome.part_path = write_part(job_dir, shard_id, manifest.num_shards, result_rows)
    return outcome


def crash_row(manifest: Manifest, shard_id: int, row_id: int, attempt: int, crashes: int) -> dict[str, Any]:
    """The error row for a poison row, with its id and passthrough columns read from the
    dataset (the raw row only: its media are not opened, they may be what crashes)."""
    from vlmbatch.job.prepare import PreparedRow
    from vlmbatch.job.shard import ResultRowFactory

    reader = manifest.open_dataset()
    raw = next(raw for batch in reader.iter_shard(manifest.shards[shard_id]) for rid, raw in batch if rid == row_id)
    error = RowError(ErrorType.WORKER_CRASH, f"this row killed its worker process {crashes} times; skipped")
    return ResultRowFactory(manifest, shard_id, attempt).failed(PreparedRow(row_id=row_id, raw=raw), error)
