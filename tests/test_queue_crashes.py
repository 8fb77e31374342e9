"""Workers that die: `kill -9` mid-shard, and a row that kills every process that opens it."""

from __future__ import annotations

import random
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.errors import ErrorType
from vlmbatch.workers.runtime import pid_of


# Loaded by every Python process of the poison test's workers (PYTHONPATH): a decoder that
# takes its process down on one particular image, as a native library crash would.
POISON_SITECUSTOMIZE = """
import os, signal
from PIL import Image

_open = Image.open

def _open_or_die(*args, **kwargs):
    image = _open(*args, **kwargs)
    if image.size == (13, 17):
        os.kill(os.getpid(), signal.SIGKILL)
    return image

Image.open = _open_or_die
"""


@pytest.mark.slow
def test_kill9_of_random_workers_five_times(tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path) -> None:
    image = tmp_path / "image.png"
    Image.new("RGB", (32, 32), "white").save(image)
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 2000, image=image)  # long enough for five kills
    workers = [start_worker(tiny_qwen, redis_server.url) for _ in range(3)]
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=100)
    kills = 0
    rng = random.Random(0)
    while kills < 5:
        holders = qh.wait_for(lambda: qh.running_shards(job_dir, redis_server.url), 120, "a shard to be running")
        try:  # SIGKILL a worker process that holds a shard's lease: the kill lands mid-shard
            psutil.Process(pid_of(rng.choice(sorted(holders.values())))).kill()
        except psutil.NoSuchProcess:
            continue  # it finished and its lease expired meanwhile
        kills += 1
        time.sleep(1.5)
    for worker in workers:  # each killed worker process was restarted by its `vlmbatch worker`
        qh.wait_for(worker.child, 30, "the killed worker process to be restarted")
    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=240)
    qh.assert_job_completed(job_dir, redis_server.url)


def test_poison_row_is_isolated_as_an_error_row(tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path) -> None:
    fine, poison = tmp_path / "fine.png", tmp_path / "poison.png"
    Image.new("RGB", (32, 32), "white").save(fine)
    Image.new("RGB", (13, 17), "red").save(poison)
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 12, image=fine, images_at={5: poison})
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISON_SITECUSTOMIZE)
    env = {"PYTHONPATH": str(site), "VLMBATCH_QUEUE_POISON_CRASHES": "2"}
    for _ in range(2):
        start_worker(tiny_qwen, redis_server.url, env=env)
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=4)

    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=180)
    status = qh.assert_job_completed(job_dir, redis_server.url)
    import pyarrow.parquet as pq

    rows = {r["row_id"]: r for r in pq.read_table(job_dir / "results").to_pylist()}
    assert rows[5]["error_type"] == ErrorType.WORKER_CRASH and rows[5]["id"] == "r5"
    assert all(rows[i]["error_type"] is None for i in rows if i != 5)  # the rest of its shard generated
    assert status.rows_failed == 1
