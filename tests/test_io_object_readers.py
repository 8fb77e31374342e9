"""Datasets on a real S3 server (SeaweedFS): planned from metadata without reading whole
objects, shards read back exactly their rows, bad objects refused by URL.

The bytes the server sends are counted by a proxy in front of it, so "not the whole
object" is measured on the wire, whatever library made the requests.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_harness import ByteCountingProxy, S3Endpoint

from vlmbatch.errors import JobError
from vlmbatch.io.readers import ROW_IDS_BYTE_OFFSET, DatasetReader, ShardPlan, open_dataset

ROWS = 20_000


@pytest.fixture
def proxy(s3_server: S3Endpoint) -> Iterator[ByteCountingProxy]:
    host, port = s3_server.url.removeprefix("http://").split(":")
    counting = ByteCountingProxy((host, int(port)))
    yield counting
    counting.close()


def upload(s3_server: S3Endpoint, name: str, data: bytes) -> str:
    """Put `data` in the bucket directly (not through the proxy); returns its s3:// URL."""
    key = f"{s3_server.bucket}/datasets-{uuid.uuid4().hex[:8]}/{name}"
    with s3_server.arrow_fs().open_output_stream(key) as out:
        out.write(data)
    return f"s3://{key}"


def plan_through(proxy: ByteCountingProxy, s3: S3Endpoint, url: str, shard_size: int) -> tuple[DatasetReader, list[ShardPlan], int]:
    """Open and plan `url` through the counting proxy; returns the reader, its plans and the bytes read."""
    proxy.reset()
    reader = open_dataset(url, storage_options=s3.with_url(proxy.url).storage_options())
    plans = reader.plan_shards(shard_size)
    return reader, plans, proxy.bytes_to_client


def jsonl_bytes() -> tuple[bytes, list[int]]:
    """ROWS lines (a few blank ones and a long one among them) and the offset of each row's line."""
    lines, offsets, position = [], [], 0
    for i in range(ROWS):
        if i % 997 == 5:
            lines.append(b"\n")  # blank lines belong to no row
            position += 1
        text = "x" * (5000 if i == 7_777 else 40 + i % 50)
        line = json.dumps({"id": f"r{i}", "prompt": text, "n": i}).encode() + b"\n"
        offsets.append(position)
        lines.append(line)
        position += len(line)
    return b"".join(lines), offsets


def test_jsonl_is_planned_by_windows_and_shards_read_their_rows(s3_server: S3Endpoint, proxy: ByteCountingProxy) -> None:
    data, offsets = jsonl_bytes()
    reader, plans, planning = plan_through(proxy, s3_server, upload(s3_server, "rows.jsonl", data), 2000)
    assert planning < len(data) // 5, f"planning read {planning:,} of {len(data):,} bytes"

    assert reader.column_names == ["id", "prompt", "n"] and reader.passthrough_schema().names == ["n"]
    assert {plan.row_ids for plan in plans} == {ROW_IDS_BYTE_OFFSET}
    assert plans[0].byte_start == 0 and plans[-1].byte_end == len(data)
    assert all(a.byte_end == b.byte_start for a, b in zip(plans, plans[1:]))
    assert 8 <= len(plans) <= 12  # ~2000 rows each, by the sample's mean line length

    seen: list[int] = []
    for plan in plans:
        proxy.reset()
        rows = [(row_id, raw) for batch in reader.iter_shard(plan) for row_id, raw in batch]
        shard_bytes = plan.byte_end - plan.byte_start
        assert proxy.bytes_to_client < shard_bytes + 64 * 1024, "a shard read more than its byte range"
        assert all(plan.row_start <= row_id < plan.row_end for row_id, _ in rows)
        assert all(raw["id"] == f"r{offsets.index(row_id)}" for row_id, raw in rows[:50])
        seen.extend(row_id for row_id, _ in rows)
    assert seen == offsets  # every row exactly once, ids are the offsets of their lines


def test_parquet_is_planned_from_the_footer_and_shards_read_their_row_groups(
    s3_server: S3Endpoint, proxy: ByteCountingProxy, tmp_path: Path
) -> None:
    table = pa.table({
        "id": [f"r{i}" for i in range(ROWS)],
        "prompt": [f"prompt {i} " + "y" * 150 for i in range(ROWS)],
        "score": [float(i) for i in range(ROWS)],
    })  # fmt: skip
    local = tmp_path / "rows.parquet"
    pq.write_table(table, local, row_group_size=1000, compression="none")
    data = local.read_bytes()
    reader, plans, planning = plan_through(proxy, s3_server, upload(s3_server, "rows.parquet", data), 2500)
    assert planning < len(data) // 20, f"planning read {planning:,} of {len(data):,} bytes"
    assert [p.row_groups for p in plans[:2]] == [[0, 1, 2], [2, 3, 4]] and len(plans) == 8

    seen: list[int] = []
    for plan in plans:
        proxy.reset()
        rows = [(row_id, raw) for batch in reader.iter_shard(plan) for row_id, raw in batch]
        assert proxy.bytes_to_client < len(data) // 4, "a shard read more than its row groups"
        assert [row_id for row_id, _ in rows] == list(range(plan.row_start, plan.row_end))
        assert all(raw["id"] == f"r{row_id}" for row_id, raw in rows)
        seen.extend(row_id for row_id, _ in rows)
    assert seen == list(range(ROWS))


def test_missing_and_unreadable_objects_are_refused_by_url(s3_server: S3Endpoint) -> None:
    options = s3_server.storage_options()
    missing = f"s3://{s3_server.bucket}/no-such-prefix/rows.jsonl"
    with pytest.raises(JobError, match=f"dataset not found: {missing}"):
        open_dataset(missing, storage_options=options)
    garbage = upload(s3_server, "broken.parquet", b"PAR1 this is not parquet")
    with pytest.raises(JobError, match=f"{garbage}: not a readable Parquet file"):
        open_dataset(garbage, storage_options=options)
    good = upload(s3_server, "rows.jsonl", b'{"prompt": "hi"}\n')
    with pytest.raises(JobError, match=f"cannot read dataset {good}"):
        open_dataset(good, storage_options={**options, "secret": "wrong"})
    with pytest.raises(JobError, match="is not a file"):
        open_dataset(good.rsplit("/", 1)[0], storage_options=options)
