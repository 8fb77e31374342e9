"""Readers: format detection, job-level validation, shard plans from metadata, streamed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.io.readers import (
    FORMAT_JSONL,
    FORMAT_OPENAI_BATCH,
    FORMAT_PARQUET,
    ColumnMap,
    open_dataset,
)


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def all_rows(reader, plans=None, batch_size=2):
    if plans is None:
        return [item for batch in reader.iter_rows(batch_size) for item in batch]
    return [item for plan in plans for batch in reader.iter_shard(plan, batch_size) for item in batch]


@pytest.fixture
def messy_jsonl(tmp_path: Path) -> Path:
    """Seven rows, with blank/whitespace lines, a bad JSON line, a non-UTF-8 line, a non-object, no final newline."""
    return write_lines(
        tmp_path / "data.jsonl",
        [
            b"\n",
            b'{"id": "a", "prompt": "p0", "n": 0}\n',
            b'{"id": "b", "prompt": "p1", "n": 1}\r\n',
            b"   \t \n",
            b'{"id": "c", "prompt": \n',
            b'{"id": "d", "prompt": "\xff\xfe"}\n',
            b"[1, 2]\n",
            b"\n",
            b'{"id": "e", "prompt": "p5", "n": 5}\n',
            b'{"id": "f", "prompt": "p6", "n": 6}',
        ],
    )


def test_jsonl_rows_ids_and_row_errors(messy_jsonl: Path) -> None:
    reader = open_dataset(messy_jsonl)
    assert reader.format == FORMAT_JSONL
    assert reader.num_rows() == 7
    rows = all_rows(reader)
    assert [row_id for row_id, _ in rows] == list(range(7))
    assert [row["id"] for _, row in rows if not isinstance(row, RowError)] == ["a", "b", "e", "f"]
    errors = {row_id: row for row_id, row in rows if isinstance(row, RowError)}
    assert sorted(errors) == [2, 3, 4]
    assert all(error.error_type == ErrorType.INVALID_ROW for error in errors.values())
    assert "JSON" in errors[2].message and "UTF-8" in errors[3].message and "list" in errors[4].message


def test_jsonl_shards_cover_every_row_once(messy_jsonl: Path) -> None:
    reader = open_dataset(messy_jsonl)
    plans = reader.plan_shards(3)
    assert [(p.shard_id, p.row_start, p.row_end) for p in plans] == [(0, 0, 3), (1, 3, 6), (2, 6, 7)]
    assert plans[0].byte_start == 1  # the leading blank line belongs to no row
    assert plans[-1].byte_end == messy_jsonl.stat().st_size
    assert all(a.byte_end == b.byte_start for a, b in zip(plans, plans[1:]))
    by_shard = all_rows(reader, plans)
    whole = all_rows(reader)
    assert [r for r, _ in by_shard] == [r for r, _ in whole]
    assert [v if isinstance(v, dict) else v.message for _, v in by_shard] == [
        v if isinstance(v, dict) else v.message for _, v in whole
    ]
    # bounded batches: never more than batch_size rows at a time
    assert max(len(batch) for batch in reader.iter_shard(plans[0], batch_size=2)) == 2
    # a plan is JSON-serialisable and reads back the same rows
    again = type(plans[1]).from_dict(json.loads(json.dumps(plans[1].to_dict())))
    assert [r for b in reader.iter_shard(again) for r, _ in b] == [3, 4, 5]


TOOLS = [{"type": "function", "function": {"name": "weather"}}]


def test_openai_batch_lines_map_to_row_contract(tmp_path: Path) -> None:
    def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"

    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    path = write_lines(
        tmp_path / "batch.jsonl",
        [
            line("req-1", {"model": "m", "messages": messages, "max_tokens": 7, "temperature": 0}),
            line("req-2", {"model": "m", "messages": messages, "max_completion_tokens": 9, "seed": 3,
                           "mm_processor_kwargs": {"max_patches": 2}}),
            line("req-3", {"model": "m", "input": "x"}, url="/v1/embeddings"),
            line("req-4", {"model": "m"}),
            line("req-5", {"model": "m", "messages": messages, "tools": TOOLS}),
            line("req-6", {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": "none"}),
        ],
    )
    reader = open_dataset(path, ColumnMap())
    assert reader.format == FORMAT_OPENAI_BATCH
    assert reader.columns.id == "custom_id"
    rows = dict(all_rows(reader))
    assert rows[0] == {"custom_id": "req-1", "messages": messages, "max_tokens": 7, "temperature": 0}
    assert rows[1] == {"custom_id": "req-2", "messages": messages, "max_tokens": 9, "seed": 3, "mm_processor_kwargs": {"max_patches": 2}}
    assert isinstance(rows[2], RowError) and "/v1/embeddings" in rows[2].message
    assert isinstance(rows[3], RowError) and rows[3].param == "body.messages"
    assert isinstance(rows[4], RowError) and rows[4].param == "body.tools" and "tool_choice" in rows[4].message
    assert rows[5] == {"custom_id": "req-6", "messages": messages}  # answered as text


def hf_image_table(n: int) -> pa.Table:
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "prompt": [f"prompt {i}" for i in range(n)],
            "image": pa.array([{"bytes": bytes([i]), "path": f"{i}.png"} for i in range(n)], type=image_type),
            "score": pa.array([i / 2 for i in range(n)], pa.float32()),
            "thumb": pa.array([b"x"] * n, pa.binary()),
            "tags": pa.array([["t"]] * n, pa.list_(pa.string())),
            "error": ["shadowed"] * n,
        }
    )


def test_parquet_shards_use_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(hf_image_table(10), path, row_group_size=3)  # groups: 0-2, 3-5, 6-8, 9
    reader = open_dataset(path)
    assert reader.format == FORMAT_PARQUET and reader.num_rows() == 10
    plans = reader.plan_shards(4)
    assert [(p.row_start, p.row_end, p.row_groups) for p in plans] == [(0, 4, [0, 1]), (4, 8, [1, 2]), (8, 10, [2, 3])]
    rows = all_rows(reader, plans, batch_size=2)
    assert [r for r, _ in rows] == list(range(10))
    assert [row["id"] for _, row in rows] == [f"r{i}" for i in range(10)]
    assert rows[5][1]["image"] == {"bytes": b"\x05", "path": "5.png"}
    assert max(len(b) for b in reader.iter_shard(plans[1], batch_size=3)) <= 3
    assert reader.passthrough_schema() == pa.schema([pa.field("score", pa.float32())])


def test_jsonl_passthrough_schema_from_sample(tmp_path: Path) -> None:
    rows = [
        {"id": 1, "prompt": "p", "image": "a.png", "i": 1, "f": 1, "b": True, "s": "x", "mixed": 1, "nested": {"a": 1}},
        {"id": 2, "prompt": "p", "image": "b.png", "i": 2, "f": 2.5, "b": False, "s": None, "mixed": "y", "model": "x"},
    ]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r).encode() + b"\n" for r in rows])
    schema = open_dataset(path).passthrough_schema()
    assert schema == pa.schema(
        [("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_()), ("s", pa.string()), ("mixed", pa.string())]
    )


def test_empty_datasets_are_not_errors(tmp_path: Path) -> None:
    empty_jsonl = write_lines(tmp_path / "e.jsonl", [b"\n", b"  \n"])
    empty_parquet = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_parquet)
    for path in (empty_jsonl, empty_parquet):
        reader = open_dataset(path)
        assert reader.num_rows() == 0
        assert reader.plan_shards(10) == []
        assert list(reader.iter_rows()) == []


@pytest.mark.parametrize(
    ("name", "content", "columns", "expected"),
    [
        ("missing.jsonl", None, None, "dataset not found"),
        ("data.csv", b"id,prompt\n1,hi\n", None, "unknown dataset format"),
        ("data.parquet", b"not parquet at all", None, "not a readable Parquet file"),
        ("data.json", b'[{"prompt": "a"}]\n', None, "is it JSON Lines"),
        ("data.jsonl", b'{"question": "q", "img": "a.png"}\n', None, "found: question, img"),
        ("data.jsonl", b'{"prompt": "q", "img": "a.png"}\n', ColumnMap(image="picture"), "image='picture' not found"),
    ],
)
def test_job_errors_are_one_line(tmp_path: Path, name, content, columns, expected) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(JobError) as caught:
        open_dataset(path, columns)
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_directory_and_remapped_columns(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not a file"):
        open_dataset(tmp_path)
    path = write_lines(tmp_path / "q.jsonl", [b'{"uid": 1, "question": "q", "picture": "a.png", "k": 2}\n'])
    reader = open_dataset(path, ColumnMap(id="uid", prompt="question", image="picture"))
    assert reader.passthrough_schema().names == ["k"]


def test_recorded_format_skips_detection(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "rows.txt", [b'\xef\xbb\xbf{"prompt": "a"}\n'])  # BOM, unknown extension
    with pytest.raises(JobError, match="unknown dataset format"):
        open_dataset(path)
    reader = open_dataset(path, format=FORMAT_JSONL)
    assert [row for batch in reader.iter_rows() for _, row in batch] == [{"prompt": "a"}]
    with pytest.raises(JobError, match="unknown dataset format 'csv'"):
        open_dataset(path, format="csv")
