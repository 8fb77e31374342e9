"""Redis goes away: `kill -9` mid-job (as a worker takes a shard) and back 5 s later, and lost entirely (resume from the folder)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.job.parts import committed_shards
from vlmbatch.job.queue import job_status
from vlmbatch.workers.local import VLMBATCH



def test_redis_kill9_and_restart_mid_job(tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 400)
    for _ in range(2):
        start_worker(tiny_qwen, redis_server.url)
    with qh.deliveries(redis_server, timeout=120) as wait_delivery:
        manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=40)
        # A worker takes a message only once it acked its last (prefetch 1, acks late), so the
        # third is taken after a commit, by a worker about to start that shard while the other
        # runs its own: Redis dies just before the shard's first Redis calls (cancel flag,
        # lease). A task that failed on them had its message acked once Redis was back, and
        # the job waited for that shard forever; polling for "a commit and a running shard"
        # (shards here take ~0.1 s) hit that moment only by chance.
        wait_delivery(3)
        redis_server.kill9()
    assert committed_shards(manifest)
    time.sleep(5)
    redis_server.start()  # same port, same append-only file

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=150)
    qh.assert_job_completed(job_dir, redis_server.url)


@pytest.mark.slow
def test_resume_rebuilds_a_job_after_redis_lost_everything(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    # 25 shards: with the preprocessing pool kept across shards, 5 of them all finished
    # between the second commit and the worker's stop
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 1000)
    worker = start_worker(tiny_qwen, redis_server.url)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=40)
    qh.wait_for(lambda: len(committed_shards(manifest)) >= 2, 120, "two committed shards")
    worker.stop()
    redis_server.client().flushall()  # queue, counters, leases: all gone
    done_before = committed_shards(manifest)
    assert job_status(job_dir, redis_server.url).state == "lost"  # `wait` says so instead of hanging

    subprocess.run([VLMBATCH, "resume", str(job_dir)], check=True)
    status = job_status(job_dir, redis_server.url)
    assert status.shards["done"] == len(done_before)
    assert status.rows_done == sum(manifest.shards[s].num_rows for s in done_before)  # counted from the parts
    start_worker(tiny_qwen, redis_server.url)
    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=120)
    qh.assert_job_completed(job_dir, redis_server.url)
