"""The dataset generators, read back through the readers and the image loader."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vlmbatch.errors import ErrorType, RowError
from vlmbatch.io.readers import FORMAT_OPENAI_BATCH, open_dataset
from vlmbatch.media.image import MediaContext, load_image
from vlmbatch.testing.data import write_image_dataset, write_large_parquet, write_openai_batch


def outcome(raw, ctx: MediaContext) -> str:
    """'ok' or the error type a row ends in, as far as reading and image loading go."""
    if isinstance(raw, RowError):
        return raw.error_type
    try:
        load_image(raw["image"], ctx)
    except RowError as error:
        return error.error_type
    return "ok"


@pytest.mark.parametrize(
    ("fmt", "image_mode"),
    [("jsonl", "path"), ("jsonl", "hf_struct"), ("jsonl", "data_url"),
     ("parquet", "path"), ("parquet", "bytes"), ("parquet", "hf_struct"), ("parquet", "data_url")],
)  # fmt: skip
def test_image_datasets_with_bad_rows(tmp_path: Path, fmt: str, image_mode: str) -> None:
    bad = {1: "corrupt", 3: "truncated"} | ({} if image_mode == "bytes" else {4: "missing"})
    if fmt == "jsonl":
        bad[6] = "invalid_json"
    path = write_image_dataset(tmp_path / f"data.{fmt}", 10, fmt=fmt, image_mode=image_mode, bad_rows=bad)
    reader = open_dataset(path)
    ctx = MediaContext(base_dir=path.parent)
    got = {row_id: outcome(raw, ctx) for batch in reader.iter_rows() for row_id, raw in batch}
    expected = {i: "ok" for i in range(10)} | {1: ErrorType.MEDIA_DECODE, 3: ErrorType.MEDIA_DECODE}
    expected |= {4: ErrorType.MEDIA_NOT_FOUND} if 4 in bad else {}
    expected |= {6: ErrorType.INVALID_ROW} if 6 in bad else {}
    assert got == expected
    assert reader.passthrough_schema().names == ["category", "index"]


def test_prompt_style_and_bad_combinations(tmp_path: Path) -> None:
    path = write_image_dataset(tmp_path / "p.jsonl", 2, prompt_style="prompt")
    rows = [raw for batch in open_dataset(path).iter_rows() for _, raw in batch]
    assert rows[0]["prompt"] and "messages" not in rows[0]
    with pytest.raises(ValueError):
        write_image_dataset(tmp_path / "b.jsonl", 2, image_mode="bytes")
    with pytest.raises(ValueError):
        write_image_dataset(tmp_path / "b.parquet", 2, fmt="parquet", bad_rows={0: "invalid_json"})


def test_openai_batch_file(tmp_path: Path) -> None:
    reader = open_dataset(write_openai_batch(tmp_path / "batch.jsonl", 3))
    assert reader.format == FORMAT_OPENAI_BATCH and reader.num_rows() == 3
    (_, first), *_ = next(reader.iter_rows())
    assert first["custom_id"] == "request-0" and first["max_tokens"] == 16
    url = first["messages"][0]["content"][1]["image_url"]["url"]
    assert load_image(url).size == (64, 48)


def test_large_parquet_plans_from_metadata(tmp_path: Path) -> None:
    started = time.monotonic()
    path = write_large_parquet(tmp_path / "big.parquet", 25_000, image_size=(32, 32), chunk_rows=10_000)
    assert time.monotonic() - started < 10
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    reader = open_dataset(path)
    plans = reader.plan_shards(4_000)
    assert reader.num_rows() == 25_000 and len(plans) == 7
    assert plans[2].row_groups == [0, 1]  # rows 8000-12000 straddle the first row-group boundary
    rows = [item for batch in reader.iter_shard(plans[2], batch_size=1000) for item in batch]
    assert [r for r, _ in rows] == list(range(8_000, 12_000))
    assert rows[0][1]["id"] == "row-0008000" and load_image(rows[0][1]["image"]).size == (32, 32)
