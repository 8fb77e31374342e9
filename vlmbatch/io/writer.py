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

from vlmbatch.errors import ErrorType
from vlmbatch.io.atomic import atomic_file, write_new
from vlmbatch.io.manifest import Manifest, part_name, results_dir, staging_dir
from vlmbatch.io.output_schema import OutputColumn, OutputMismatch, job_output_column
from vlmbatch.io.schema import (
    GENERATED_TEXT_FIELD,
    LOGPROBS_FIELD,
    RESULT_STATUS_FIELDS,
    ROW_ID_FIELD,
    SAMPLE_INDEX_FIELD,
    SAMPLING_COLUMNS_KEY,
    coerce_scalar,
)
from vlmbatch.io.storage import Location

log = logging.getLogger(__name__)


def _passthrough_fields(manifest: Manifest, output: OutputColumn | None) -> list[pa.Field]:
    """The input's passthrough scalars, less one named like the job's structured-output column."""
    return [f for f in manifest.passthrough_schema if output is None or f.name != output.name]


def result_schema(manifest: Manifest) -> pa.Schema:
    """row_id, id (or custom_id), `sample_index` (n > 1), the input's passthrough scalars,
    generated_text, the structured `output` / `output_json` column of a structured job
    (io/output_schema.py), `logprobs` (when asked for), then the status columns."""
    output = job_output_column(manifest.extra)
    id_field = pa.field(manifest.result_id_column, pa.string())
    structured = [output.field] if output is not None else []
    asked = manifest.extra.get(SAMPLING_COLUMNS_KEY, [])
    samples = [SAMPLE_INDEX_FIELD] if SAMPLE_INDEX_FIELD.name in asked else []
    logprobs = [LOGPROBS_FIELD] if LOGPROBS_FIELD.name in asked else []
    return pa.schema([ROW_ID_FIELD, id_field, *samples, *_passthrough_fields(manifest, output), GENERATED_TEXT_FIELD,
                      *structured, *logprobs, *RESULT_STATUS_FIELDS])


def passthrough_values(manifest: Manifest, raw_row: dict[str, Any]) -> dict[str, Any]:
    """The passthrough columns of one raw input row (the writer fits their types)."""
    return {f.name: raw_row.get(f.name) for f in _passthrough_fields(manifest, job_output_column(manifest.extra))}


def _fit_output(row: dict[str, Any], output: OutputColumn) -> None:
    """The generated text the runner put under the column's name → the column's value; text
    that does not fit becomes null and, if the row had no error yet, its error."""
    text = row.get(output.name)
    if text is None:
        return
    try:
        row[output.name] = output.convert(text)
    except OutputMismatch as exc:
        row[output.name] = None
        if row.get("error_type") is None:
            row["error_type"], row["error"] = ErrorType.STRUCTURED_OUTPUT_INVALID, f"structured output: {exc}"


def _result_rows(manifest: Manifest, shard_id: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by row_id, with input-derived values fitted and the known columns filled in."""
    finished_at = datetime.now(timezone.utc)
    output = job_output_column(manifest.extra)
    fitted_fields = [pa.field(manifest.result_id_column, pa.string()), *_passthrough_fields(manifest, output)]
    result = []
    for row in sorted(rows, key=lambda r: r["row_id"]):
        row = {"model": manifest.model, "shard_id": shard_id, "finished_at": finished_at, **row}
        for fitted in fitted_fields:
            row[fitted.name] = coerce_scalar(row.get(fitted.name), fitted.type)
        if output is not None:
            _fit_output(row, output)
        result.append(row)
    return result


def write_part(
    job_dir: str | Location, shard_id: int, num_shards: int, rows: list[dict[str, Any]], *, replace: bool = False
) -> Location:
    """Commit one shard's result rows as `results/part-SSSSS-of-NNNNN.parquet`; returns its location.

    Each row dict holds result columns by name (missing ones are null; `model`,
    `shard_id` and `finished_at` default to the manifest's model, this shard and now).
    A structured job's rows hold the generated text of each constrained row under the
    output column's name (`output` or `output_json`); it is parsed and typed here.
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
