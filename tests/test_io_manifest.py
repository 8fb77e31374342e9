"""Manifest: planning from a reader, atomic save, exact round trip, job ids."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import JobError
from vlmbatch.io.manifest import MANIFEST_NAME, Manifest, new_job_id, staging_dir
from vlmbatch.io.readers import ColumnMap, open_dataset


def make_manifest(tmp_path: Path) -> Manifest:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"p{i}", "n": i, "lang": "en"}) + "\n" for i in range(5)))
    reader = open_dataset(data, ColumnMap(prompt="q"))
    return Manifest.for_dataset(
        reader,
        output_dir=tmp_path / "out",
        model="tiny",
        engine="hf",
        sampling=SamplingParams(max_tokens=8, temperature=0).to_dict(),
        shard_size=2,
        media_io_kwargs={"video": {"fps": 2}},
    )


def test_plan_save_load_round_trip(tmp_path: Path) -> None:
    manifest = make_manifest(tmp_path)
    assert manifest.num_rows == 5 and manifest.num_shards == 3
    assert manifest.passthrough_schema == pa.schema([("n", pa.int64()), ("lang", pa.string())])
    path = manifest.save()
    assert path == tmp_path / "out" / manifest.job_id / MANIFEST_NAME
    assert list(staging_dir(manifest.job_dir).iterdir()) == []  # the temp file was renamed, not left
    loaded = Manifest.load(manifest.job_dir)
    assert loaded == manifest
    assert loaded.part_path(1).name == "part-00001-of-00003.parquet"
    assert json.loads(path.read_text())["columns"]["prompt"] == "q"


def test_moved_job_folder_follows_its_location(tmp_path: Path) -> None:
    manifest = make_manifest(tmp_path)
    manifest.save()
    moved = tmp_path / "elsewhere" / manifest.job_id
    shutil.move(manifest.job_dir, moved)
    assert Manifest.load(moved).part_path(0).parent == moved.resolve() / "results"


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not a job folder"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{ half")
    with pytest.raises(JobError, match="unreadable manifest"):
        Manifest.load(tmp_path)


def test_job_ids_are_sortable_and_unique() -> None:
    ids = [new_job_id() for _ in range(200)]
    assert all(re.fullmatch(r"job-\d{8}-\d{6}-[0-9a-f]{6}", job_id) for job_id in ids)
    assert len(set(ids)) == len(ids)
