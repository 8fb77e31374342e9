"""Part writer: schema order, value fitting, atomic commit, first writer wins, replacement."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlmbatch.io.atomic import atomic_file, write_new
from vlmbatch.io.manifest import Manifest, staging_dir
from vlmbatch.io.readers import open_dataset
from vlmbatch.io.writer import passthrough_values, result_schema, write_part


@pytest.fixture
def job(tmp_path: Path) -> Manifest:
    data = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": "p", "n": i, "tag": "t"} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = Manifest.for_dataset(
        open_dataset(data), output_dir=tmp_path / "out", model="tiny", engine="hf", sampling={}, shard_size=2
    )
    manifest.save()
    return manifest


def test_schema_column_order(job: Manifest) -> None:
    assert result_schema(job).names == [
        "row_id", "id", "n", "tag", "generated_text", "finish_reason", "num_input_tokens",
        "num_generated_tokens", "error_type", "error", "model", "shard_id", "attempt", "finished_at",
    ]  # fmt: skip


def test_write_part_sorts_fits_and_fills(job: Manifest) -> None:
    raw = {"id": 3, "prompt": "p", "n": "not an int", "tag": 5}
    rows = [
        {"row_id": 3, "id": raw["id"], **passthrough_values(job, raw), "error_type": "media_decode_error",
         "error": "bad", "finish_reason": "error", "attempt": 2},
        {"row_id": 2, "id": 2, "n": 2, "tag": "t", "generated_text": "ok", "finish_reason": "stop",
         "num_input_tokens": 10, "num_generated_tokens": 3, "attempt": 2},
    ]  # fmt: skip
    path = write_part(job.job_dir, 1, job.num_shards, rows)
    assert path == job.part_path(1)
    table = pq.read_table(path)
    assert table.schema == result_schema(job)
    got = table.to_pylist()
    assert [r["row_id"] for r in got] == [2, 3]
    assert got[1]["id"] == "3" and got[1]["n"] is None and got[1]["tag"] == "5"  # documented fitting policy
    assert {r["model"] for r in got} == {"tiny"} and {r["shard_id"] for r in got} == {1}
    assert got[0]["finished_at"] <= datetime.now(timezone.utc)


def test_empty_part_is_typed_the_first_commit_wins_and_replace_replaces(job: Manifest) -> None:
    empty = write_part(job.job_dir, 0, job.num_shards, [])
    assert pq.read_table(empty).num_rows == 0 and pq.read_schema(empty) == result_schema(job)
    # A second attempt of the shard (a redelivery) finds its part committed: the part stays as it was.
    assert write_part(job.job_dir, 0, job.num_shards, [{"row_id": 0, "generated_text": "late"}]) == empty
    assert pq.read_table(empty).num_rows == 0
    write_part(job.job_dir, 0, job.num_shards, [{"row_id": 0, "generated_text": "a"}], replace=True)  # --retry-errors
    assert pq.read_table(empty).column("generated_text").to_pylist() == ["a"]
    assert list(staging_dir(job.job_dir).iterdir()) == []


def test_racing_local_commits_have_exactly_one_winner(tmp_path: Path) -> None:
    final = tmp_path / "results" / "part-00000-of-00001.parquet"
    start = threading.Barrier(8)
    won: list[tuple[int, bool]] = []

    def commit(writer: int) -> None:
        def write(handle) -> None:
            start.wait()
            pq.write_table(pa.table({"writer": [writer] * 1000}), handle)

        won.append((writer, write_new(final, write, tmp_path / "staging")))

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [writer for writer, ok in won if ok]
    assert len(winners) == 1
    assert pq.read_table(final).column("writer").to_pylist() == winners * 1000  # whole, and the winner's
    assert list((tmp_path / "staging").iterdir()) == []


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    final = tmp_path / "results" / "part-00000-of-00001.parquet"
    with atomic_file(final, tmp_path / "staging") as handle:
        pq.write_table(pa.table({"a": [1]}), handle)
    with pytest.raises(RuntimeError):
        with atomic_file(final, tmp_path / "staging") as handle:
            handle.write(b"half a file")
            raise RuntimeError("crash mid-write")
    assert pq.read_table(final).column("a").to_pylist() == [1]
    assert list((tmp_path / "staging").iterdir()) == []


INVOICE = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string"},
        "total": {"type": "number"},
        "currency": {"enum": ["USD", "EUR"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {"qty": {"type": "integer"}}, "required": ["qty"]}},
    },
    "required": ["vendor", "total"],
}


@pytest.fixture
def structured_job(tmp_path: Path) -> Manifest:
    """A job with one schema over an input that has its own `output` column (a reference answer)."""
    from vlmbatch.io.output_schema import MANIFEST_KEY, manifest_entry
    from vlmbatch.structured.spec import parse_structured_output

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": "p", "output": "reference", "k": i}) + "\n" for i in range(5)))
    manifest = Manifest.for_dataset(open_dataset(data), output_dir=tmp_path / "out", model="tiny", engine="hf", sampling={}, shard_size=3)
    manifest.extra[MANIFEST_KEY] = manifest_entry(parse_structured_output({"guided_json": INVOICE}), per_row=False)
    manifest.save()
    return Manifest.load(manifest.job_dir)


def _generated(row_id: int, text: str, **status) -> dict:
    # What the shard runner hands over: the constrained row's text under the output column's name.
    return {"row_id": row_id, "id": row_id, "k": row_id, "generated_text": text, "output": text, "finish_reason": "stop", **status}


def test_structured_output_column_is_typed_and_every_reader_agrees(structured_job: Manifest, tmp_path: Path) -> None:
    import duckdb
    import pyarrow.dataset as ds

    from vlmbatch.io.results import merge

    job = structured_job
    assert result_schema(job).names[:6] == ["row_id", "id", "k", "generated_text", "output", "finish_reason"]  # input `output` yields
    good = json.dumps({"vendor": "Acme", "total": 12.5, "currency": "EUR", "lines": [{"qty": 2}]})
    write_part(job.job_dir, 0, job.num_shards, [
        _generated(0, good),
        _generated(1, '{"vendor": "Ac', finish_reason="length", error_type="structured_output_incomplete", error="max_tokens"),
        _generated(2, json.dumps({"vendor": "Globex", "total": 3})),
    ])  # fmt: skip
    write_part(job.job_dir, 1, job.num_shards, [
        _generated(3, json.dumps({"vendor": "Big", "total": 1, "lines": [{"qty": 2**64}]})),
        {"row_id": 4, "id": 4, "finish_reason": "error", "error_type": "media_decode_error", "error": "bad"},  # never generated
    ])  # fmt: skip
    parts = sorted((job.job_dir / "results").glob("*.parquet"))
    assert len({pq.read_schema(p) for p in parts}) == 1 and pq.read_schema(parts[0]) == result_schema(job)

    rows = duckdb.sql(
        f"select row_id, output.total, output.vendor, output.currency, output.lines[1].qty, error_type "
        f"from '{job.job_dir}/results/*.parquet' order by row_id"
    ).fetchall()
    assert rows == [
        (0, 12.5, "Acme", "EUR", 2, None),
        (1, None, None, None, None, "structured_output_incomplete"),  # the runner's error is kept
        (2, 3.0, "Globex", None, None, None),
        (3, None, None, None, None, "structured_output_invalid"),  # 2**64 does not fit int64
        (4, None, None, None, None, "media_decode_error"),
    ]
    table = ds.dataset(job.job_dir / "results", format="parquet").to_table()
    assert table.schema.field("output").type == result_schema(job).field("output").type
    assert table.sort_by("row_id").column("output").to_pylist()[2] == {"vendor": "Globex", "total": 3.0, "currency": None, "lines": None}
    merged = tmp_path / "merged.parquet"
    assert merge(job.job_dir, merged) == 5
    assert pq.read_table(merged).column("output").to_pylist()[0] == {"vendor": "Acme", "total": 12.5, "currency": "EUR", "lines": [{"qty": 2}]}
    assert pq.read_table(merged).column("generated_text").to_pylist()[1] == '{"vendor": "Ac'  # the text is kept


def test_per_row_schemas_get_output_json(tmp_path: Path) -> None:
    from vlmbatch.io.output_schema import MANIFEST_KEY, manifest_entry

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": 0, "prompt": "p", "response_format": '{"type": "json_object"}'}) + "\n")
    manifest = Manifest.for_dataset(open_dataset(data), output_dir=tmp_path / "out", model="tiny", engine="hf", sampling={}, shard_size=2)
    manifest.extra[MANIFEST_KEY] = manifest_entry(None, per_row=True)
    manifest.save()
    write_part(manifest.job_dir, 0, 1, [{"row_id": 0, "generated_text": '{"a": [1]}', "output_json": '{"a": [1]}'},
                                        {"row_id": 1, "generated_text": "free text"}])  # fmt: skip
    table = pq.read_table(manifest.part_path(0))
    assert table.schema.field("output_json").type == pa.string()
    assert table.column("output_json").to_pylist() == ['{"a": [1]}', None]
