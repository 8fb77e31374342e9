"""The shutdown matrix: SIGTERM, SIGQUIT and a double SIGINT on a worker in mid-shard."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.workers.store import JobStore, RowRange, connect

pytestmark = pytest.mark.slow

SIGNALS = {
    "SIGTERM": [signal.SIGTERM],
    "SIGQUIT": [signal.SIGQUIT],
    "double SIGINT": [signal.SIGINT, signal.SIGINT],
}


@pytest.mark.parametrize("how", list(SIGNALS))
def test_shutdown_mid_shard_requeues_the_shard(
    how: str, tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 240)
    first = start_worker(tiny_qwen, redis_server.url)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=80)
    shard_id = next(iter(qh.wait_for(lambda: qh.running_shards(job_dir, redis_server.url), 120, "a running shard")))
    for sig in SIGNALS[how]:
        first.process.send_signal(sig)  # to `vlmbatch worker`, which forwards it
        time.sleep(0.3)
    first.process.wait(30)  # the shard stopped at its next step instead of running to its end
    assert not manifest.part_path(shard_id).exists()

    start_worker(tiny_qwen, redis_server.url)  # the requeued shard runs here, without any timeout
    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=150)
    qh.assert_job_completed(job_dir, redis_server.url)
    plan = manifest.shards[shard_id]
    store = JobStore(connect(redis_server.url), manifest.job_id)
    assert store.crashes(RowRange(plan.row_start, plan.row_end)) == 0  # a shutdown is not a crash
