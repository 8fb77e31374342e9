"""Results: summary, ordered merge, errors; pyarrow, DuckDB and Polars read the parts, never a staging file."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from vlmbatch.errors import JobError
from vlmbatch.io.atomic import atomic_file
from vlmbatch.io.manifest import Manifest, staging_dir
from vlmbatch.io.readers import open_dataset
from vlmbatch.io.results import iter_errors, merge, summarize
from vlmbatch.io.writer import write_part


def ok(row_id: int) -> dict:
    return {"row_id": row_id, "id": f"r{row_id}", "k": row_id, "generated_text": f"t{row_id}", "finish_reason": "stop",
            "num_input_tokens": 10, "num_generated_tokens": 2}  # fmt: skip


def failed(row_id: int, error_type: str) -> dict:
    return {"row_id": row_id, "id": f"r{row_id}", "k": row_id, "finish_reason": "error", "error_type": error_type, "error": "x"}


@pytest.fixture
def job(tmp_path: Path) -> Manifest:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "p", "k": i}) + "\n" for i in range(7)))
    manifest = Manifest.for_dataset(
        open_dataset(data), output_dir=tmp_path / "out", model="tiny", engine="hf", sampling={}, shard_size=3
    )
    manifest.save()
    return manifest


def commit_shards_0_and_2(job: Manifest) -> None:
    write_part(job.job_dir, 2, job.num_shards, [ok(6)])
    write_part(job.job_dir, 0, job.num_shards, [ok(2), failed(1, "media_decode_error"), ok(0)])


def glob_counts(job_dir: Path) -> tuple[int, int, int]:
    pattern = str(job_dir / "results" / "*.parquet")
    duck = duckdb.sql(f"select count(*) from read_parquet('{pattern}')").fetchall()[0][0]
    polars = pl.scan_parquet(pattern).select(pl.len()).collect().item()
    arrow = ds.dataset(job_dir / "results", format="parquet").count_rows()
    return duck, polars, arrow


def test_summary_of_a_partial_job(job: Manifest) -> None:
    commit_shards_0_and_2(job)
    summary = summarize(job.job_dir)
    assert (summary.parts_committed, summary.parts_planned) == (2, 3)
    assert (summary.rows, summary.rows_ok, summary.rows_failed) == (4, 3, 1)
    assert summary.errors_by_type == {"media_decode_error": 1}
    assert (summary.input_tokens, summary.output_tokens) == (30, 6)
    assert summary.missing_shards == [1] and summary.missing_row_ranges == [(3, 6)]
    assert not summary.complete


def test_summary_finds_holes_and_duplicates_inside_a_part(job: Manifest) -> None:
    write_part(job.job_dir, 0, job.num_shards, [ok(0), ok(0)])
    write_part(job.job_dir, 1, job.num_shards, [ok(3), ok(4), ok(5)])
    write_part(job.job_dir, 2, job.num_shards, [ok(6)])
    summary = summarize(job.job_dir)
    assert summary.duplicate_row_ids == [0] and summary.missing_row_ranges == [(1, 3)]
    write_part(job.job_dir, 0, job.num_shards, [ok(0), ok(1), ok(2)], replace=True)
    assert summarize(job.job_dir).complete


def test_merge_is_ordered_and_every_reader_agrees(job: Manifest, tmp_path: Path) -> None:
    write_part(job.job_dir, 1, job.num_shards, [ok(5), ok(3), failed(4, "media_timeout")])
    commit_shards_0_and_2(job)
    merged = tmp_path / "merged.parquet"
    assert merge(job.job_dir, merged) == 7
    table = pq.read_table(merged)
    assert table.column("row_id").to_pylist() == list(range(7))
    assert table.column("k").to_pylist() == list(range(7))  # passthrough column kept
    assert glob_counts(job.job_dir) == (7, 7, 7)
    ordered = duckdb.sql(f"select row_id from read_parquet('{job.job_dir}/results/*.parquet') order by row_id").fetchall()
    assert [r[0] for r in ordered] == list(range(7))
    errors_file = tmp_path / "errors.parquet"
    assert merge(job.job_dir, errors_file, errors_only=True) == 2
    assert pl.read_parquet(errors_file)["error_type"].to_list() == ["media_decode_error", "media_timeout"]
    assert [(r["row_id"], r["error_type"]) for r in iter_errors(job.job_dir)] == [
        (1, "media_decode_error"), (4, "media_timeout"),
    ]  # fmt: skip
    with pytest.raises(JobError, match="must not go into"):
        merge(job.job_dir, job.job_dir / "results" / "all.parquet")


def test_globs_never_see_a_part_being_written(job: Manifest) -> None:
    commit_shards_0_and_2(job)
    with atomic_file(job.part_path(1), staging_dir(job.job_dir)) as handle:
        handle.write(b"PAR1 half-written part")
        (temp,) = staging_dir(job.job_dir).iterdir()
        assert not temp.name.endswith(".parquet")
        assert glob_counts(job.job_dir) == (4, 4, 4)
        recursive = duckdb.sql(f"select count(*) from read_parquet('{job.job_dir}/**/*.parquet')").fetchall()[0][0]
        assert recursive == 4
