"""The shutdown matrix: SIGTERM, SIGQUIT and a double SIGINT on a worker in mid-shard."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.workers.runtime import pid_of
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
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 1200)  # shards of seconds: the signal lands early
    workers = [start_worker(tiny_qwen, redis_server.url) for _ in range(2)]
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=600)
    holders = qh.wait_for(lambda: qh.running_shards(job_dir, redis_server.url), 120, "a running shard")
    shard_id, holder = next(iter(holders.items()))
    victim = next(w for w in workers if w.child() is not None and w.child().pid == pid_of(holder))
    for sig in SIGNALS[how]:
        victim.process.send_signal(sig)  # to `vlmbatch worker`, which forwards it
        time.sleep(0.3)
    assert victim.process.wait(30) == 0  # the shard stopped at its next step, not at its end

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=150)
    qh.assert_job_completed(job_dir, redis_server.url)
    attempts = pq.read_table(manifest.part_path(shard_id), columns=["attempt"]).column("attempt").to_pylist()
    assert set(attempts) == {2}  # committed by the second run, not by the interrupted one
    plan = manifest.shards[shard_id]
    store = JobStore(connect(redis_server.url), manifest.job_id)
    assert store.crashes(RowRange(plan.row_start, plan.row_end)) == 0  # a shutdown is not a crash
