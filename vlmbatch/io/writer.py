"""Result parts: one Parquet file per shard, committed atomically.

A part is written to `JOB/staging/` under a name that never ends in `.parquet`,
fsync'd, then `os.replace`d into `JOB/results/`, and the folder is fsync'd. Readers
globbing `results/*.parquet` (pyarrow, DuckDB, Polars) therefore see every part whole
or not at all, and a retried shard replaces its part in one step.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vlmbatch.io.atomic import atomic_file
from vlmbatch.io.manifest import Manifest, part_name, results_dir, staging_dir
from vlmbatch.io.schema import RESULT_TAIL_FIELDS, ROW_ID_FIELD, coerce_scalar


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


def write_part(job_dir: str | Path, shard_id: int, num_shards: int, rows: list[dict[str, Any]]) -> Path:
    """Commit one shard's result rows as `results/part-SSSSS-of-NNNNN.parquet`.

    Each row dict holds result columns by name (missing ones are null; `model`,
    `shard_id` and `finished_at` default to the manifest's model, this shard and now).
    An empty list still writes a typed, empty part so the shard counts as done.
    """
    job_dir = Path(job_dir)
    manifest = Manifest.load(job_dir)
    schema = result_schema(manifest)
    table = pa.Table.from_pylist(_result_rows(manifest, shard_id, rows), schema=schema)
    final = results_dir(job_dir) / part_name(shard_id, num_shards)
    with atomic_file(final, staging_dir(job_dir)) as handle:
        pq.write_table(table, handle)
    return final
