"""Nothing outlives a process killed with SIGKILL: `vlmbatch worker` (its GPU-slot process,
that one's fork server and preprocessing workers) and the in-process runner of `vlmbatch
submit` (its preprocessing pool). The queue case also checks that a new `vlmbatch worker`
finishes the job with every row exactly once (the killed shard is delivered again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.workers.local import VLMBATCH
from vlmbatch.workers.runtime import pid_of

pytestmark = pytest.mark.slow  # model loads on a busy 2-core machine: ~1 min each

# Orphans must be gone this soon after their ancestor's death (they watch every 0.5 s).
GONE_WITHIN_S = 10


def alive(process: psutil.Process) -> bool:
    """Running (a zombie that nobody reaped yet does not count)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill9_and_expect_no_descendant(process: subprocess.Popen[bytes], at_least: int) -> None:
    descendants = psutil.Process(process.pid).children(recursive=True)
    assert len(descendants) >= at_least, [p.cmdline()[:4] for p in descendants]
    process.kill()
    process.wait()
    qh.wait_for(lambda: not any(alive(p) for p in descendants), GONE_WITHIN_S, "every descendant to exit")


def test_kill9_of_the_supervisor_leaves_no_process_and_loses_no_row(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 400)
    env = {"VLMBATCH_PREPROCESS_WORKERS": "1"}  # a preprocessing pool: grandchildren to leave behind
    doomed, survivor = start_worker(tiny_qwen, redis_server.url, env=env), start_worker(tiny_qwen, redis_server.url)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=25)

    def doomed_runs_a_shard() -> list[int]:
        child = doomed.child()
        held = qh.running_shards(job_dir, redis_server.url)
        return [s for s, worker in held.items() if child is not None and pid_of(worker) == child.pid]

    running = qh.wait_for(doomed_runs_a_shard, 120, "the doomed worker to run a shard")
    # its GPU-slot process, that one's fork server and preprocessing worker, the resource tracker
    kill9_and_expect_no_descendant(doomed.process, at_least=4)
    interrupted = [s for s in running if not manifest.part_path(s).exists()]

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=120)  # the other worker finishes
    qh.assert_job_completed(job_dir, redis_server.url)
    for shard_id in interrupted:  # delivered again after the crash, and run again
        attempts = pq.read_table(manifest.part_path(shard_id), columns=["attempt"]).column("attempt").to_pylist()
        assert set(attempts) == {2}, (shard_id, attempts)
    assert survivor.process.poll() is None


def test_kill9_of_an_in_process_job_leaves_no_preprocessing_process(tmp_path: Path, tiny_qwen: Path) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 3000)
    env = qh.worker_env({"VLMBATCH_PREPROCESS_WORKERS": "1"})
    log = tmp_path / "submit.log"
    with open(log, "wb") as out:
        submit = subprocess.Popen([VLMBATCH, "submit", str(dataset), "--model", str(tiny_qwen), "--output",
                                   str(tmp_path / "out"), "--max-tokens", "2", "--shard-size", "100"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        def pool_started() -> bool:  # the fork server has forked the preprocessing worker
            return any(p.parent() and p.parent().pid != submit.pid for p in psutil.Process(submit.pid).children(recursive=True))

        qh.wait_for(pool_started, 120, "the preprocessing pool to start")
        # the fork server, its preprocessing worker, the resource tracker
        kill9_and_expect_no_descendant(submit, at_least=3)
    finally:
        if submit.poll() is None:
            submit.kill()
