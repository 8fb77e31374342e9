"""`RowPreparer` with a real tiny model, real media and real worker processes: the same
prepared rows as in this thread, a crashing row confined to itself, one thread per worker."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.readers import open_dataset
from vlmbatch.job.prepare import PreparedRow
from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.testing.data import write_image_dataset

CRASH_WORD = "CRASH-THE-WORKER"


@dataclass(frozen=True)
class CrashingAdapterSpec(AdapterSpec):
    """Loads the real adapter, made to kill its process on prompts with CRASH_WORD (a decoder segfault)."""

    def load(self) -> ModelAdapter:
        adapter = super().load()
        prepare = adapter.prepare

        def crash_or_prepare(prompt: str, *args: Any, **kwargs: Any) -> Any:
            if CRASH_WORD in prompt:
                os._exit(139)
            return prepare(prompt, *args, **kwargs)

        adapter.prepare = crash_or_prepare  # type: ignore[method-assign]
        return adapter


def _job(tmp_path: Path, model: Path, crash_row: int | None = None) -> tuple[Manifest, list[tuple[int, Any]]]:
    dataset = write_image_dataset(tmp_path / "rows.jsonl", 10, image_mode="data_url", image_format="JPEG",
                                  bad_rows={2: "corrupt"})  # fmt: skip
    if crash_row is not None:
        lines = dataset.read_text().splitlines()
        row = json.loads(lines[crash_row])
        row["messages"][0]["content"] = f"{CRASH_WORD}: what is this?"
        lines[crash_row] = json.dumps(row)
        dataset.write_text("\n".join(lines) + "\n")
    reader = open_dataset(dataset)
    manifest = Manifest.for_dataset(reader, output_dir=tmp_path / "out", model=str(model), engine="hf",
                                    sampling={"max_tokens": 4}, shard_size=100)  # fmt: skip
    rows = [row for batch in reader.iter_rows() for row in batch]
    return manifest, rows


def _by_row(items: list[PreparedRow]) -> dict[int, PreparedRow]:
    return {item.row_id: item for item in items}


def _prepared(rows: list[tuple[int, Any]], manifest: Manifest, spec: AdapterSpec, num_workers: int | None = None,
              **options: Any) -> list[PreparedRow]:
    preparation = RowPreparation.for_job(manifest, spec, SamplingParams(max_tokens=4), MediaConfig())
    with RowPreparer(WorkerConfig(preprocess_workers=num_workers), MediaConfig(), **options) as preparer:
        return list(preparer.prepare(rows, preparation))


def test_parallel_rows_equal_the_sequential_ones(tmp_path: Path, tiny_qwen: Path) -> None:
    manifest, rows = _job(tmp_path, tiny_qwen)
    spec = AdapterSpec(str(tiny_qwen))
    expected = _by_row(_prepared(rows, manifest, spec, num_workers=0))
    got = _by_row(_prepared(rows, manifest, spec, num_workers=2, max_pending=4))
    assert sorted(got) == sorted(expected) == list(range(10))
    assert got[2].error is not None and got[2].error.error_type == ErrorType.MEDIA_DECODE
    for row_id, item in expected.items():
        if row_id == 2:
            continue
        assert item.prepared is not None and got[row_id].prepared is not None
        assert got[row_id].prepared.prompt_token_ids == item.prepared.prompt_token_ids
        for theirs, ours in zip(item.prepared.media, got[row_id].prepared.media, strict=True):
            assert (ours.kind, ours.num_tokens, ours.content_hash) == (theirs.kind, theirs.num_tokens, theirs.content_hash)
            assert ours.tensors.keys() == theirs.tensors.keys()
            assert all(torch.equal(ours.tensors[key], tensor) for key, tensor in theirs.tensors.items())


def test_a_row_that_kills_its_worker_becomes_a_worker_crash_row(tmp_path: Path, tiny_qwen: Path) -> None:
    manifest, rows = _job(tmp_path, tiny_qwen, crash_row=5)
    spec = CrashingAdapterSpec(str(tiny_qwen))
    got = _by_row(_prepared(rows, manifest, spec, num_workers=2))
    assert sorted(got) == list(range(10))
    assert got[5].error is not None and got[5].error.error_type == ErrorType.WORKER_CRASH
    assert got[5].raw["id"] == "row-00005"  # the row keeps its input for the result columns
    assert all(got[row_id].prepared is not None for row_id in range(10) if row_id not in (2, 5))


def test_zero_workers_prepares_in_order_in_this_thread(tmp_path: Path, tiny_qwen: Path) -> None:
    manifest, rows = _job(tmp_path, tiny_qwen)
    got = _prepared(rows, manifest, AdapterSpec(str(tiny_qwen)), num_workers=0)
    assert [item.row_id for item in got] == list(range(10))


@dataclass(frozen=True)
class ThreadReportingAdapterSpec(AdapterSpec):
    """Loads the real adapter, made to fail every row with the thread counts it runs with."""

    def load(self) -> ModelAdapter:
        adapter = super().load()

        def report(*args: Any, **kwargs: Any) -> Any:
            from vlmbatch.media.video.options import cpu_decoder_threads

            raise RowError(ErrorType.INVALID_ROW, f"threads {torch.get_num_threads()} {cpu_decoder_threads()}")

        adapter.prepare = report  # type: ignore[method-assign]
        return adapter


def test_workers_decode_with_one_thread_each(tmp_path: Path, tiny_qwen: Path) -> None:
    """The pool is the parallelism: torch ops and video decoders in a worker use one thread."""
    from vlmbatch.media.video.options import cpu_decoder_threads

    manifest, rows = _job(tmp_path, tiny_qwen)
    got = _prepared(rows[:2], manifest, ThreadReportingAdapterSpec(str(tiny_qwen)), num_workers=1)
    assert [item.error.message for item in got] == ["threads 1 1"] * 2
    assert cpu_decoder_threads() == 0  # the owner keeps the libraries' defaults
