"""A step that fails mid-shard costs one row, not the shard: the step's rows are rerun one
by one, the row that still fails gets `engine_error`, the others get the tokens a clean run
gives them, and the part commits."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.engine.llm import LLM
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.readers import open_dataset
from vlmbatch.job.preparer import RowPreparer
from vlmbatch.job.shard import run_shard
from vlmbatch.testing.data import write_image_dataset

POISONED = "2"  # the row id whose presence makes every engine step fail


def _run(dataset: Path, output_dir: Path, llm: LLM) -> dict[int, dict]:
    """One shard of the rows at `dataset` in a job of its own (a committed part is never replaced)."""
    manifest = Manifest.for_dataset(open_dataset(dataset), output_dir=output_dir, model=llm.model_name, engine="paged",
                                    sampling={"max_tokens": 4, "temperature": 0.0}, shard_size=5)  # fmt: skip
    manifest.save()
    preparer = RowPreparer(WorkerConfig(preprocess_workers=1), MediaConfig())
    try:
        outcome = run_shard(manifest, manifest.job_dir, 0, llm, preparer=preparer)
    finally:
        preparer.close()
    return {row["row_id"]: row for row in pq.read_table(outcome.part_path).to_pylist()}


def test_a_failing_step_isolates_the_bad_row_and_the_shard_commits(tmp_path: Path, tiny_qwen: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    dataset = write_image_dataset(tmp_path / "rows.jsonl", 5, image_mode="data_url")
    llm = LLM(str(tiny_qwen), engine="paged", device="cpu", dtype="float32")
    clean = _run(dataset, tmp_path / "clean", llm)
    assert len(clean) == 5 and all(row["error_type"] is None for row in clean.values())

    engine_step = llm.engine.step

    def failing_step():  # a fault that follows one row (a kernel crashing on its shapes, say)
        if POISONED in llm.engine.requests:
            raise RuntimeError(f"kernel exploded on row {POISONED}")
        return engine_step()

    llm.engine.step = failing_step
    caplog.set_level(logging.WARNING, logger="vlmbatch.job.shard")
    rows = _run(dataset, tmp_path / "faulty", llm)

    assert sorted(rows) == [0, 1, 2, 3, 4]
    bad = rows[int(POISONED)]
    assert bad["error_type"] == "engine_error" and bad["finish_reason"] == "error"
    assert bad["error"] == f"RuntimeError: kernel exploded on row {POISONED}"
    for row_id, row in rows.items():
        if row_id != int(POISONED):
            assert row["error_type"] is None and row["generated_text"] == clean[row_id]["generated_text"], row_id
    assert not llm.engine.has_unfinished_requests()  # nothing of the failed step was left queued
    assert any("engine step failed (RuntimeError: kernel exploded" in r.getMessage() for r in caplog.records)
