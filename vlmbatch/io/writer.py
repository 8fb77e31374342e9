"""Result parts: one Parquet file per shard, committed atomically, first writer wins.

A part is written to a temp file whose name never ends in `.parquet` (in `JOB/staging/`
for a local job, in the local temp folder for an object-storage job), fsync'd, then
committed into `JOB/results/` only if no part of that shard is there yet (`io.atomic`:
`os.link` locally, a conditional put on S3). Readers globbing `results/*.parquet`
(pyarrow, DuckDB, Polars) therefore see every part whole or not at all, and once a part
is there it never changes: when two attempts of one shard finish (a redelivery), the
first to commit wins and the other's rows are dropped. Only a retry of a part's error
rows (`replace=True`) replaces a part, in one step.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vlmbatch.io.atomic import atomic_file, write_new
from vlmbatch.io.manifest import Manifest, part_name, results_dir, staging_dir
from vlmbatch.io.schema import RESULT_TAIL_FIELDS, ROW_ID_FIELD, coerce_scalar
from vlmbatch.io.storage import Location

log = logging.getLogger(__name__)


def result_schema(manifest: Manifest) -> pa.Schema:
    """row_id, id (or custom_id), the input's passthrough scalars, then the fixed result columns."""
    id_field = pa.field(manifest.result_id_column, pa.string())
    return pa.schema([ROW_ID_FIELD, id_field, *manifest.passthrough_schema, *RESULT_TAIL_FIELDS])


def passthrough_values(manifest: Manifest, raw_row: dict[str, Any]) -> dict[str, Any]:
    """The passthrough columns of one raw input row (the writer fits their types)."""
    return {name: raw_row.get(name) for name in manifest.passthrough_schema.names}


def _result_rows(manifest: Manifest, shard_id: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by row_id, with input-derived values fitted and the known columns filled in."""
    finished_at = datetime.now(timezone.utc)
    fitted_fields = [pa.field(manifest.result_id_column, pa.string()), *manifest.passthrough_schema]
    result = []
    for row in sorted(rows, key=lambda r: r["row_id"]):
        row = {"model": manifest.model, "shard_id": shard_id, "finished_at": finished_at, **row}
        for fitted in fitted_fields:
            row[fitted.name] = coerce_scalar(row.get(fitted.name), fitted.type)
        result.append(row)
    return result


def write_part(
    job_dir: str | Location, shard_id: int, num_shards: int, rows: list[dict[str, Any]], *, replace: bool = False
) -> Location:
    """Commit one shard's result rows as `results/part-SSSSS-of-NNNNN.parquet`; returns its location.

    Each row dict holds result columns by name (missing ones are null; `model`,
    `shard_id` and `finished_at` default to the manifest's model, this shard and now).
    An empty list still writes a typed, empty part so the shard counts as done. A part
    that is already there is kept (another attempt committed first) unless `replace`.
    """
    manifest = Manifest.load(job_dir)
    schema = result_schema(manifest)
    table = pa.Table.from_pylist(_result_rows(manifest, shard_id, rows), schema=schema)
    final = results_dir(manifest.job_dir) / part_name(shard_id, num_shards)
    staging = staging_dir(manifest.job_dir)
    if replace:
        with atomic_file(final, staging) as handle:
            pq.write_table(table, handle)
    elif not write_new(final, lambda handle: pq.write_table(table, handle), staging):
        log.info("%s was committed by another attempt first; this attempt's %d rows are dropped", final, len(rows))
    return final
