"""Job folders on a real S3 server (SeaweedFS): the manifest beside the results, parts
committed exactly once (conditional puts), summary / merge / errors over the bucket, and
pyarrow, DuckDB and Polars reading the results where they lie."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import botocore.exceptions
import botocore.session
import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from s3_harness import S3Endpoint

from vlmbatch.io.atomic import write_new
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.readers import open_dataset
from vlmbatch.io.results import iter_errors, merge, summarize
from vlmbatch.io.storage import ObjectPath, resolve
from vlmbatch.io.writer import write_part


def client(s3: S3Endpoint):
    """A plain botocore client (no vlmbatch code between the test and the server)."""
    return botocore.session.get_session().create_client("s3", endpoint_url=s3.url, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name=s3.region)  # fmt: skip


def keys_under(s3: S3Endpoint, prefix: str) -> list[str]:
    pages = client(s3).get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return sorted(item["Key"].removeprefix(prefix) for page in pages for item in page.get("Contents", []))


def ok(row_id: int) -> dict:
    return {"row_id": row_id, "id": f"r{row_id}", "k": row_id, "generated_text": f"t{row_id}", "finish_reason": "stop",
            "num_input_tokens": 10, "num_generated_tokens": 2}  # fmt: skip


def failed(row_id: int) -> dict:
    return {"row_id": row_id, "id": f"r{row_id}", "k": row_id, "finish_reason": "error",
            "error_type": "media_decode_error", "error": "x"}  # fmt: skip


@pytest.fixture
def s3_job(s3_server: S3Endpoint, tmp_path: Path) -> Manifest:
    """A 7-row job (shards of 3) whose dataset (Parquet) and output are both in the bucket."""
    prefix = f"s3://{s3_server.bucket}/jobs-{uuid.uuid4().hex[:8]}"
    options = s3_server.storage_options()
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(7)], "prompt": ["p"] * 7, "k": list(range(7))}), data)
    dataset = resolve(f"{prefix}/in.parquet", options)
    dataset.storage.put(data, dataset.path)
    reader = open_dataset(dataset)
    manifest = Manifest.for_dataset(reader, output_dir=f"{prefix}/out", model="tiny", engine="hf", sampling={},
                                    shard_size=3, storage_options=options)  # fmt: skip
    manifest.save()
    return manifest


def test_the_store_refuses_a_second_conditional_put_with_412(s3_server: S3Endpoint, tmp_path: Path) -> None:
    """The protocol rests on this: SeaweedFS honours `If-None-Match: *` (as AWS S3 does)."""
    key = f"conditional-{uuid.uuid4().hex}"
    s3 = client(s3_server)
    s3.put_object(Bucket=s3_server.bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3.put_object(Bucket=s3_server.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"first"
    target = resolve(f"s3://{s3_server.bucket}/{key}", s3_server.storage_options())
    (tmp_path / "third").write_bytes(b"third")
    assert not target.storage.put_new(tmp_path / "third", target.path)  # our wrapper reads the 412 as "lost"
    assert target.read_bytes() == b"first"


def test_the_manifest_lies_beside_the_results(s3_job: Manifest, s3_server: S3Endpoint) -> None:
    assert isinstance(s3_job.job_dir, ObjectPath) and s3_job.dataset.startswith("s3://")
    loaded = Manifest.load(str(s3_job.job_dir), s3_server.storage_options())
    assert loaded.to_dict() == s3_job.to_dict() and loaded.job_dir == s3_job.job_dir
    assert "secret" not in json.dumps(loaded.to_dict())  # storage options are never stored
    assert [r for b in loaded.open_dataset().iter_shard(loaded.shards[2]) for r in b] == [(6, {"id": "r6", "prompt": "p", "k": 6})]


@pytest.mark.parametrize("size", [1000, 11 * 1024**2], ids=["small", "11MiB"])
def test_racing_commits_of_one_part_have_exactly_one_winner(
    s3_job: Manifest, s3_server: S3Endpoint, size: int
) -> None:
    """Attempts of a shard finish at once (a redelivery): exactly one part appears, whole."""
    final = s3_job.part_path(0)
    writers = 3
    start = threading.Barrier(writers)
    won: dict[int, bool] = {}

    def commit(writer: int) -> None:
        def write(handle) -> None:
            pq.write_table(pa.table({"writer": [writer] * (size // 8)}), handle, compression="none", use_dictionary=False)
            start.wait()  # every writer uploads at once

        won[writer] = write_new(final, write)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    winners = [writer for writer, ok in won.items() if ok]
    assert len(won) == writers and len(winners) == 1, won
    column = pq.read_table(final.open_input()).column("writer").to_pylist()
    assert column == winners * (size // 8)  # whole, and the winner's
    etag = client(s3_server).head_object(Bucket=s3_server.bucket, Key=final.path.split("/", 1)[1])["ETag"]
    assert "-" not in etag  # one PUT, not a multipart upload (whose ETag counts its parts): the store decides the race


def test_summary_merge_and_errors_over_the_bucket(s3_job: Manifest, s3_server: S3Endpoint, tmp_path: Path) -> None:
    job_dir, shards = s3_job.job_dir, s3_job.num_shards
    write_part(job_dir, 2, shards, [ok(6)])
    write_part(job_dir, 0, shards, [ok(2), failed(1), ok(0)])
    assert write_part(job_dir, 0, shards, [ok(0), ok(1), ok(2)]) == s3_job.part_path(0)  # late duplicate: dropped
    url, options = str(job_dir), s3_server.storage_options()
    partial = summarize(url, options)
    assert (partial.parts_committed, partial.rows, partial.rows_failed, partial.missing_row_ranges) == (2, 4, 1, [(3, 6)])
    write_part(job_dir, 1, shards, [ok(5), ok(3), ok(4)])
    summary = summarize(url, options)
    assert summary.complete and (summary.rows, summary.rows_ok, summary.errors_by_type) == (7, 6, {"media_decode_error": 1})

    merged = tmp_path / "merged.parquet"
    assert merge(url, merged, storage_options=options) == 7
    assert pq.read_table(merged).column("row_id").to_pylist() == list(range(7))
    assert [r["row_id"] for r in iter_errors(url, options)] == [1]
    remote_merge = f"s3://{s3_server.bucket}/merged-{uuid.uuid4().hex[:8]}/errors.parquet"
    assert merge(url, remote_merge, errors_only=True, storage_options=options) == 1

    # Nothing but the manifest and the parts lies under the job: no staging object, ever.
    job_prefix = job_dir.path.split("/", 1)[1] + "/"
    assert keys_under(s3_server, job_prefix) == ["manifest.json"] + [f"results/part-0000{i}-of-00003.parquet" for i in range(3)]
    check_readers_where_results_lie(s3_server, job_dir, expected_rows=7)


def check_readers_where_results_lie(s3: S3Endpoint, job_dir: ObjectPath, expected_rows: int) -> None:
    """pyarrow, Polars and DuckDB read `results/` in the bucket, as the README shows."""
    results = f"{job_dir}/results"
    table = ds.dataset(results.removeprefix("s3://"), filesystem=s3.arrow_fs(), format="parquet").to_table()
    assert sorted(table.column("row_id").to_pylist()) == list(range(expected_rows))

    polars_options = {"aws_endpoint_url": s3.url, "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
                      "aws_region": s3.region, "aws_allow_http": "true"}  # fmt: skip
    frame = pl.scan_parquet(f"{results}/*.parquet", storage_options=polars_options).select("row_id").collect()
    assert sorted(frame["row_id"].to_list()) == list(range(expected_rows))

    con = duckdb.connect()
    if duckdb_httpfs(con, s3):
        count = con.execute(f"select count(distinct row_id) from read_parquet('{results}/*.parquet')").fetchone()[0]
    else:  # no httpfs here: the same files through a pyarrow dataset registered in DuckDB
        con.register("results", ds.dataset(results.removeprefix("s3://"), filesystem=s3.arrow_fs(), format="parquet"))
        count = con.execute("select count(distinct row_id) from results").fetchone()[0]
    assert count == expected_rows


def duckdb_httpfs(con: duckdb.DuckDBPyConnection, s3: S3Endpoint) -> bool:
    """Load DuckDB's httpfs and point it at the server; False where the extension cannot be
    had (`INSTALL httpfs` downloads it, and these machines reach no extension repository)."""
    try:
        con.sql("LOAD httpfs")
    except duckdb.Error:
        try:
            con.sql("INSTALL httpfs")
            con.sql("LOAD httpfs")
        except duckdb.Error:
            return False
    host = s3.url.removeprefix("http://")
    con.sql(f"CREATE SECRET results (TYPE s3, KEY_ID '{s3.access_key}', SECRET '{s3.secret_key}', REGION '{s3.region}', "
            f"ENDPOINT '{host}', URL_STYLE 'path', USE_SSL false)")  # fmt: skip
    return True
