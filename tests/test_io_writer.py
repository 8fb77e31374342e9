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
