"""A shard delivered twice runs once: two copies at once, and a shard outliving the visibility timeout."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.job.queue import enqueue_job
from vlmbatch.workers.store import JobStore, connect

pytestmark = pytest.mark.slow


def attempts(broker: str, job_id: str, shard_id: int) -> int:
    """How many times a worker started running the shard (under its lease)."""
    value = connect(broker).hget(JobStore(connect(broker), job_id).key("attempts"), str(shard_id))
    return int(value or 0)


def test_two_copies_of_a_shard_at_once_run_it_once(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 600)  # seconds of work: the copies overlap
    workers = [start_worker(tiny_qwen, redis_server.url) for _ in range(2)]
    qh.wait_for(lambda: all(w.ready_count() for w in workers), 120, "both workers to consume")
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=600)
    enqueue_job(manifest, job_dir, redis_server.url)  # the same shard again, while the first copy starts

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=120)
    qh.assert_job_completed(job_dir, redis_server.url)
    assert attempts(redis_server.url, manifest.job_id, 0) == 1
    assert set(pq.read_table(job_dir / "results", columns=["attempt"]).column("attempt").to_pylist()) == {1}
    logs = "".join(w.log_path.read_text() for w in workers)
    assert "Retry in" in logs  # the second copy was deferred, not run and not dropped


def test_shard_longer_than_the_visibility_timeout_runs_once(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    # 6,000 tiny rows: several seconds even on a quiet machine (2,000 once took only 2.8 s)
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 6000)
    env = {"VLMBATCH_QUEUE_VISIBILITY_TIMEOUT": "1.5"}  # the shard takes several of these
    workers = [start_worker(tiny_qwen, redis_server.url, env=env) for _ in range(2)]
    qh.wait_for(lambda: all(w.ready_count() for w in workers), 120, "both workers to consume")
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=6000)

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=240)
    qh.assert_job_completed(job_dir, redis_server.url)
    assert attempts(redis_server.url, manifest.job_id, 0) == 1
    started = JobStore(connect(redis_server.url), manifest.job_id).started_at()
    assert manifest.part_path(0).stat().st_mtime - started > 3  # it did outlive the timeout
    logs = "".join(w.log_path.read_text() for w in workers)
    assert logs.count("] received") == 1  # renewed while it ran: never even delivered again
