"""Reading a job's committed parts: summary, ordered merge, errors.

Everything streams record batches part by part, so a job of any size is summarised
or merged in memory bounded by one batch (plus one shard's row ids for the
missing/duplicate check). Parts hold disjoint, sorted row ranges, so concatenating
them in shard order is already ordered by row_id. A job folder may be local or on
object storage (parts are then read by ranged requests, the merged file may go either
way), and the committed parts are found by one listing of `results/`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlmbatch.errors import JobError
from vlmbatch.io.atomic import atomic_file
from vlmbatch.io.manifest import Manifest, results_dir
from vlmbatch.io.readers import ShardPlan
from vlmbatch.io.storage import Location, list_names, parquet_source, resolve
from vlmbatch.io.schema import SAMPLE_INDEX_FIELD, SAMPLING_COLUMNS_KEY
from vlmbatch.io.writer import result_schema

BATCH_ROWS = 65_536


@dataclass
class JobSummary:
    """What the committed parts of a job hold, and what is still missing from them."""

    job_id: str
    rows_planned: int | None  # None: not known before every shard is read (JSONL on object storage)
    parts_planned: int
    parts_committed: int = 0
    rows: int = 0
    rows_ok: int = 0
    rows_failed: int = 0
    errors_by_type: dict[str, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    missing_shards: list[int] = field(default_factory=list)
    missing_row_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end)
    duplicate_row_ids: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing_row_ranges and not self.duplicate_row_ids and self.parts_committed == self.parts_planned


def committed_parts(manifest: Manifest) -> Iterator[tuple[ShardPlan, Location]]:
    """The shards whose part is in `results/`, in shard (hence row_id) order."""
    present = list_names(results_dir(manifest.job_dir))
    for plan in manifest.shards:
        path = manifest.part_path(plan.shard_id)
        if path.name in present:
            yield plan, path


def read_part(path: Location, columns: list[str] | None = None) -> pa.Table:
    """One committed part, whole (a shard's worth of rows)."""
    return pq.read_table(parquet_source(path), columns=columns)


def _part_batches(path: Location, columns: list[str] | None = None, errors_only: bool = False) -> Iterator[pa.RecordBatch]:
    for batch in pq.ParquetFile(parquet_source(path)).iter_batches(batch_size=BATCH_ROWS, columns=columns):
        if errors_only:
            batch = batch.filter(pc.is_valid(batch.column("error_type")))
        if batch.num_rows:
            yield batch


def _ranges(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """[3, 4, 5, 9] → [(3, 6), (9, 10)]."""
    if sorted_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(sorted_ids, breaks)]


def summarize(job_dir: str | Location, storage_options: dict[str, Any] | None = None) -> JobSummary:
    manifest = Manifest.load(job_dir, storage_options)
    summary = JobSummary(job_id=manifest.job_id, rows_planned=manifest.num_rows, parts_planned=manifest.num_shards)
    errors: Counter[str] = Counter()
    committed = {plan.shard_id: path for plan, path in committed_parts(manifest)}
    columns = ["row_id", "error_type", "num_input_tokens", "num_generated_tokens"]
    samples = SAMPLE_INDEX_FIELD.name in manifest.extra.get(SAMPLING_COLUMNS_KEY, [])
    if samples:  # one row per sample: a row's id and prompt count once, on its first sample
        columns.append(SAMPLE_INDEX_FIELD.name)
    for plan in manifest.shards:
        path = committed.get(plan.shard_id)
        if path is None:
            summary.missing_shards.append(plan.shard_id)
            if plan.row_end > plan.row_start:
                summary.missing_row_ranges.append((plan.row_start, plan.row_end))
            continue
        summary.parts_committed += 1
        row_ids = []
        for batch in _part_batches(path, columns):
            summary.output_tokens += int(pc.sum(batch.column("num_generated_tokens")).as_py() or 0)
            if samples:
                batch = batch.filter(pc.equal(batch.column(SAMPLE_INDEX_FIELD.name), 0))
            row_ids.append(batch.column("row_id").to_numpy())
            for item in pc.value_counts(batch.column("error_type").drop_null()).to_pylist():
                errors[item["values"]] += item["counts"]
            summary.rows += batch.num_rows
            summary.input_tokens += int(pc.sum(batch.column("num_input_tokens")).as_py() or 0)
        ids, counts = np.unique(np.concatenate(row_ids) if row_ids else np.empty(0, np.int64), return_counts=True)
        summary.duplicate_row_ids.extend(int(i) for i in ids[counts > 1])
        if plan.num_rows is not None:  # byte-offset ids: which offsets start a row is known only to the part
            summary.missing_row_ranges.extend(_ranges(np.setdiff1d(np.arange(plan.row_start, plan.row_end), ids)))
    summary.errors_by_type = dict(errors)
    summary.rows_failed = sum(errors.values())
    summary.rows_ok = summary.rows - summary.rows_failed
    return summary


def merge(
    job_dir: str | Location, out_file: str | Location, errors_only: bool = False, storage_options: dict[str, Any] | None = None
) -> int:
    """Write the committed parts as one Parquet file ordered by row_id (a local path or a
    URL); returns its row count."""
    manifest = Manifest.load(job_dir, storage_options)
    out = resolve(out_file, storage_options).resolve()
    if out.parent == results_dir(manifest.job_dir):
        raise JobError(f"the merged file must not go into {out.parent}: result globs would count its rows twice")
    written = 0
    with atomic_file(out, out.parent) as handle, pq.ParquetWriter(handle, result_schema(manifest)) as writer:
        for _, path in committed_parts(manifest):
            for batch in _part_batches(path, errors_only=errors_only):
                writer.write_batch(batch)
                written += batch.num_rows
    return written


def iter_errors(job_dir: str | Location, storage_options: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every row that ended in an error, in row_id order, one dict at a time."""
    manifest = Manifest.load(job_dir, storage_options)
    for _, path in committed_parts(manifest):
        for batch in _part_batches(path, errors_only=True):
            yield from batch.to_pylist()
