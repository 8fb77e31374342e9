"""A preprocessing pool that outlives one shard: the same worker processes serve source
after source, an abandoned source never leaks rows into the next, `send(False)` never
blocks, and a `RowPreparer` starts one pool for every shard of a job (with pixels in the
engine's dtype). Also: how `vlmbatch worker` shares the host's cores among its GPU workers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from test_pool import _alive, _echo_setup, _failure
from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.io.manifest import Manifest
from vlmbatch.io.readers import open_dataset
from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer, default_num_workers
from vlmbatch.job.process_pool import ProcessPool
from vlmbatch.job.shard import pixel_dtype, run_shard
from vlmbatch.testing.data import write_image_dataset
from vlmbatch.workers.supervisor import cpu_shares, pinned_env


def test_one_pool_serves_source_after_source_with_the_same_workers() -> None:
    with ProcessPool(_echo_setup, 1000, _failure, num_workers=2, max_pending=4) as pool:
        first = list(pool.imap_unordered([(i, "a") for i in range(1, 20)]))
        second = list(pool.imap_unordered([(i, "b") for i in range(1, 20)]))
    assert sorted(r[:2] for r in first) == [(i, "a") for i in range(1, 20)]
    assert sorted(r[:2] for r in second) == [(i, "b") for i in range(1, 20)]
    assert {r[2] for r in first} == {r[2] for r in second}  # no worker was restarted
    assert pool.restarts == 0


def test_an_abandoned_source_leaks_nothing_into_the_next() -> None:
    with ProcessPool(_echo_setup, 1, _failure, num_workers=2, max_pending=4) as pool:
        first = pool.imap_unordered([(i, "old") for i in range(1, 50)])  # every row takes 0.3 s
        busy = {next(first)[2]}
        first.close()  # a cancelled shard
        assert not any(_alive(pid) for pid in busy)  # killed with the rows it still held
        second = list(pool.imap_unordered([(i, "new") for i in range(100, 104)]))
    assert sorted(r[:2] for r in second) == [(i, "new") for i in range(100, 104)]


def test_send_false_returns_none_instead_of_waiting() -> None:
    with ProcessPool(_echo_setup, 1, _failure, num_workers=1, max_pending=2) as pool:
        results = pool.imap_unordered([(1, None), (2, None)])  # 0.3 s each
        first = next(results)
        started = time.monotonic()
        assert results.send(False) is None
        assert time.monotonic() - started < 0.2
        rest = [first]
        while len(rest) < 2:
            item = results.send(False)
            if item is not None:
                rest.append(item)
        assert next(results, "end") == "end"
    assert sorted(r[0] for r in rest) == [1, 2]


@pytest.mark.parametrize(
    "cores, configured, expected",
    [
        (16, None, 14),  # two cores stay with the engine
        (8, None, 6),  # a 16-core host's share for one of two GPUs
        (4, None, 2),
        (3, None, 2),  # below four cores the engine keeps one
        (2, None, 1),
        (1, None, 1),  # never fewer than one
        (8, 3, 3),  # the configured count wins over the cores
        (2, 5, 5),  # also when it is more than the cores
        (8, 0, 0),  # 0: rows are prepared in the engine's thread
    ],
)
def test_pool_size_from_the_cores_of_this_workers_share(cores: int, configured: int | None, expected: int) -> None:
    worker = WorkerConfig(preprocess_workers=configured, worker_cpus=frozenset(range(100, 100 + cores)))
    assert default_num_workers(worker) == expected


def test_pool_size_without_a_share_follows_this_process_affinity() -> None:
    affinity = frozenset(os.sched_getaffinity(0))
    assert default_num_workers(WorkerConfig()) == default_num_workers(WorkerConfig(worker_cpus=affinity))
    assert default_num_workers(WorkerConfig.from_env({"VLMBATCH_PREPROCESS_WORKERS": "4"})) == 4
    assert default_num_workers(WorkerConfig.from_env({"VLMBATCH_WORKER_CPUS": "0-7"})) == 6


def test_each_gpu_worker_gets_its_own_cores() -> None:
    assert cpu_shares(["0", "1"], set(range(16))) == {"0": list(range(8)), "1": list(range(8, 16))}
    assert cpu_shares(["0", "1", "2"], set(range(8))) == {"0": [0, 1, 2], "1": [3, 4, 5], "2": [6, 7]}
    assert cpu_shares(["0"], set(range(16))) == {}  # one worker keeps every core
    assert cpu_shares(["0", "1"], {0, 1, 2}) == {}  # too few to split
    # hyperthreads numbered as on most x86 hosts (core i and i + 8 share a physical core)
    # stay together, so the two engines never share a physical core
    siblings = {i: f"{i % 8},{i % 8 + 8}" for i in range(16)}
    assert cpu_shares(["0", "1"], set(range(16)), siblings.__getitem__) == {
        "0": [0, 1, 2, 3, 8, 9, 10, 11], "1": [4, 5, 6, 7, 12, 13, 14, 15]}
    assert pinned_env("1", [8, 9])["VLMBATCH_WORKER_CPUS"] == "8,9"


@pytest.mark.parametrize("pin", ["1", "0"])
def test_a_worker_process_pins_itself_to_its_share(pin: str) -> None:
    share = min(os.sched_getaffinity(0))
    env = dict(os.environ, VLMBATCH_WORKER_CPUS=str(share), VLMBATCH_PIN_WORKER_CPUS=pin)
    code = ("import os; from vlmbatch.config import WorkerConfig; from vlmbatch.workers.process import pin_to_share; "
            "pin_to_share(WorkerConfig.from_env(os.environ)); print(sorted(os.sched_getaffinity(0)))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    expected = [share] if pin == "1" else sorted(os.sched_getaffinity(0))
    assert run.stdout.strip() == str(expected)


def _two_shard_job(tmp_path: Path, model: Path) -> Manifest:
    dataset = write_image_dataset(tmp_path / "rows.jsonl", 6, image_mode="data_url", image_format="JPEG")
    manifest = Manifest.for_dataset(open_dataset(dataset), output_dir=tmp_path / "out", model=str(model),
                                    engine="hf", sampling={"max_tokens": 2}, shard_size=3)  # fmt: skip
    manifest.save()
    return manifest


def test_pixels_come_back_in_the_requested_dtype(tmp_path: Path, tiny_qwen: Path) -> None:
    manifest = _two_shard_job(tmp_path, tiny_qwen)
    rows = [row for batch in open_dataset(manifest.dataset).iter_rows() for row in batch]
    spec, defaults = AdapterSpec(str(tiny_qwen)), SamplingParams(max_tokens=2)
    preparer = RowPreparer(WorkerConfig(preprocess_workers=1), MediaConfig())
    try:
        full = {r.row_id: r for r in preparer.prepare(rows, _preparation(manifest, spec, defaults, None))}
        half = {r.row_id: r for r in preparer.prepare(rows, _preparation(manifest, spec, defaults, "bfloat16"))}
    finally:
        preparer.close()
    assert preparer.starts == 1  # the job's settings travel with the rows: one pool serves both
    for row_id, item in full.items():
        (ours,), (theirs,) = half[row_id].prepared.media, item.prepared.media
        assert theirs.tensors["pixel_values"].dtype == torch.float32
        assert ours.tensors["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(ours.tensors["pixel_values"], theirs.tensors["pixel_values"].to(torch.bfloat16))
        assert ours.tensors["image_grid_thw"].dtype == theirs.tensors["image_grid_thw"].dtype


def test_one_pool_serves_jobs_with_their_own_folders(tmp_path: Path, tiny_qwen: Path) -> None:
    """Relative image paths resolve next to each job's own dataset, through the same workers."""
    spec, defaults = AdapterSpec(str(tiny_qwen)), SamplingParams(max_tokens=2)
    preparer = RowPreparer(WorkerConfig(preprocess_workers=1), MediaConfig())
    preparer.start(spec)  # as a GPU worker does once its model is loaded
    try:
        for job in ("a", "b"):
            dataset = write_image_dataset(tmp_path / job / "rows.jsonl", 3, image_mode="path")
            manifest = Manifest.for_dataset(open_dataset(dataset), output_dir=tmp_path / "out", model=str(tiny_qwen),
                                            engine="hf", sampling={"max_tokens": 2}, shard_size=3)  # fmt: skip
            rows = [row for batch in open_dataset(dataset).iter_rows() for row in batch]
            got = list(preparer.prepare(rows, _preparation(manifest, spec, defaults, None)))
            assert sorted(r.row_id for r in got) == [0, 1, 2]
            assert all(r.error is None and "pixel_values" in r.prepared.media[0].tensors for r in got), [r.error for r in got]
    finally:
        preparer.close()
    assert preparer.starts == 1 and preparer.restarts == 0


def _preparation(manifest: Manifest, spec: AdapterSpec, defaults: SamplingParams, dtype: str | None) -> RowPreparation:
    return RowPreparation(spec, str(manifest.dataset), {}, manifest.columns, defaults, MediaConfig(), dtype)


def test_every_shard_of_a_job_reuses_one_pool(tmp_path: Path, tiny_qwen: Path, caplog: pytest.LogCaptureFixture) -> None:
    from vlmbatch.engine.llm import LLM

    manifest = _two_shard_job(tmp_path, tiny_qwen)
    llm = LLM(str(tiny_qwen), engine="hf", device="cpu", dtype="bfloat16")
    assert pixel_dtype(llm) == "bfloat16"
    preparer = RowPreparer(WorkerConfig(preprocess_workers=1), MediaConfig())
    caplog.set_level(logging.INFO, logger="vlmbatch.job.shard")
    try:
        outcomes = [run_shard(manifest, manifest.job_dir, s, llm, preparer=preparer, slot="3") for s in (0, 1)]
    finally:
        preparer.close()
    assert preparer.starts == 1 and preparer.pool is None
    for outcome in outcomes:
        table = pq.read_table(outcome.part_path)
        assert table.num_rows == 3 and table.column("error_type").null_count == 3
        assert outcome.timing.engine > 0
    assert [o.timing.pool_starts for o in outcomes] == [1, 0]  # the second shard reused the pool
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shard timing:")]
    assert [line.split()[3] for line in lines] == ["shard=0", "shard=1"]
    assert all(f"job={manifest.job_id} " in line and " rows=3 " in line and " pool_workers=1 " in line for line in lines)
    assert all(" gpu=3 " in line for line in lines)  # the worker process's slot, passed down


@pytest.mark.parametrize("engine", ["hf", "paged"])
def test_pixels_follow_the_engines_dtype(tiny_qwen: Path, engine: str) -> None:
    from vlmbatch.engine.llm import LLM

    assert pixel_dtype(LLM(str(tiny_qwen), engine=engine, device="cpu")) is None  # float32 on the CPU
    assert pixel_dtype(LLM(str(tiny_qwen), engine=engine, device="cpu", dtype="bfloat16")) == "bfloat16"
    assert pixel_dtype(None) is None
