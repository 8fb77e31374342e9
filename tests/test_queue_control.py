"""Job control from the command line, and jobs of two models on one broker.

The cancel-then-resume test runs by default (CI's only run of `vlmbatch wait`, `status` and
`resume` against a real broker and worker); the others are marked slow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.io.manifest import Manifest
from vlmbatch.job.parts import committed_shards
from vlmbatch.job.queue import cancel_job, job_status
from vlmbatch.workers.local import VLMBATCH
from vlmbatch.workers.runtime import pid_of
from vlmbatch.workers.store import JobStore, connect


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLMBATCH, *args], capture_output=True, text=True, timeout=120)


def test_cancel_mid_job_then_resume(tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 240)
    start_worker(tiny_qwen, redis_server.url)  # one worker: at most one more shard ends after the cancel
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=20)
    qh.wait_for(lambda: len(committed_shards(manifest)) >= 1, 120, "a committed shard")

    cancel_job(job_dir, redis_server.url)  # what `vlmbatch cancel` does, without its start-up time
    cancelled = qh.wait_state(job_dir, redis_server.url, {"cancelled"}, timeout=60)
    assert 0 < cancelled.shards["done"] < manifest.num_shards
    assert cli("wait", str(job_dir)).returncode == 3  # a cancelled job is not a success
    shown = cli("status", str(job_dir))
    assert shown.returncode == 0 and "cancelled" in shown.stdout

    assert cli("resume", str(job_dir)).returncode == 0
    waited = cli("wait", str(job_dir))
    assert waited.returncode == 0, waited.stderr
    qh.assert_job_completed(job_dir, redis_server.url)


@pytest.mark.slow
def test_two_models_on_one_broker_go_to_their_own_workers(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path, tiny_llava: Path
) -> None:
    qwen_worker = start_worker(tiny_qwen, redis_server.url)
    llava_worker = start_worker(tiny_llava, redis_server.url)
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 40)
    output = tmp_path / "out"
    submitted = cli(
        "submit", str(dataset), "--model", str(tiny_llava), "--broker", redis_server.url,
        "--output", str(output), "--shard-size", "10", "--max-tokens", "2",
    )  # the command itself: it queues, prints the job id and returns
    assert submitted.returncode == 0, submitted.stderr
    llava_dir = output / submitted.stdout.split()[0]
    jobs = {qwen_worker: qh.submit(dataset, tiny_qwen, output, redis_server.url, shard_size=10)[1], llava_worker: llava_dir}
    for worker, job_dir in jobs.items():
        manifest = Manifest.load(job_dir)
        qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=150)
        qh.assert_job_completed(job_dir, redis_server.url)
        ran_on = {pid_of(s["worker"]) for s in JobStore(connect(redis_server.url), manifest.job_id).shard_states().values()}
        assert ran_on == {worker.child().pid}
        assert set(pq.read_table(job_dir / "results", columns=["model"]).column("model").to_pylist()) == {manifest.model}


@pytest.mark.slow
def test_resume_retry_errors_reruns_only_the_failed_rows(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    late = tmp_path / "late.png"  # missing at first: its rows fail with media_not_found
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 40, images_at={3: late, 25: late})
    start_worker(tiny_qwen, redis_server.url)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=20)
    assert qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=120).rows_failed == 2
    before = {r["row_id"]: r for r in pq.read_table(job_dir / "results").to_pylist()}

    Image.new("RGB", (32, 32), "white").save(late)
    assert cli("resume", str(job_dir), "--retry-errors").returncode == 0

    def retried() -> bool:
        status = job_status(job_dir, redis_server.url)
        return status.state == "completed" and status.rows_failed == 0

    qh.wait_for(retried, 120, "the failed rows to succeed")
    qh.assert_job_completed(job_dir, redis_server.url)
    after = {r["row_id"]: r for r in pq.read_table(job_dir / "results").to_pylist()}
    assert after[3]["error_type"] is None and after[25]["error_type"] is None
    assert after[3]["attempt"] == 2 and after[0]["attempt"] == 1  # only the failed rows ran again
    assert after[0]["generated_text"] == before[0]["generated_text"]


@pytest.mark.slow
def test_failed_shards_fail_the_job_until_resumed(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 40)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=20)
    dataset.rename(tmp_path / "away.jsonl")  # the shared folder lost the input: no shard can run
    start_worker(tiny_qwen, redis_server.url)

    failed = qh.wait_state(job_dir, redis_server.url, {"failed"}, timeout=120)
    assert failed.shards["failed"] == 2 and len(failed.errors) == 2
    assert cli("wait", str(job_dir)).returncode == 1

    (tmp_path / "away.jsonl").rename(dataset)
    assert cli("resume", str(job_dir)).returncode == 0
    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=120)
    qh.assert_job_completed(job_dir, redis_server.url)
