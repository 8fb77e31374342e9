"""Real systems for the queue tests: a private redis-server, `vlmbatch worker` processes.

Nothing is mocked: Redis runs on a free port with an append-only file (so a `kill -9`
and restart keeps the queue), workers are the real command in subprocesses with a clean
environment, and they are killed with real signals.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis

from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.io.manifest import Manifest, part_name, results_dir
from vlmbatch.job.plan import plan_job
from vlmbatch.job.queue import JobStatus, enqueue_job, job_status
from vlmbatch.workers.store import JobStore, connect
from vlmbatch.workers.local import RedisServer, WorkerCommand, wait_until

# Short enough that crash recovery fits in a test, long enough for a loaded 2-core CI box.
TEST_VISIBILITY_TIMEOUT = 4.0


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    """`wait_until` that fails the test (not errors it) at the deadline."""
    try:
        return wait_until(condition, timeout, what)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder)
    server.start()
    yield server
    server.stop()


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment: nothing of the test process leaks in but what a worker needs."""
    keep = ("PATH", "HOME", "LANG", "PYENV_VERSION", "VIRTUAL_ENV", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        VLMBATCH_QUEUE_VISIBILITY_TIMEOUT=str(TEST_VISIBILITY_TIMEOUT),
        VLMBATCH_QUEUE_POISON_CRASHES="2",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerCommand]]:
    """`start_worker(model, broker, dry_run=False, env=None)`; every worker is stopped at teardown."""
    started: list[WorkerCommand] = []

    def start(model: str, broker: str, dry_run: bool = False, env: dict[str, str] | None = None) -> WorkerCommand:
        worker = WorkerCommand(str(model), broker, tmp_path / f"worker-{len(started)}.log", worker_env(env), dry_run)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def assert_exactly_once(job_dir: Path) -> None:
    """Every input row appears exactly once, and `results/*.parquet` holds only whole parts."""
    manifest = Manifest.load(job_dir)
    expected = {part_name(s.shard_id, manifest.num_shards) for s in manifest.shards}
    visible = {p.name for p in results_dir(job_dir).glob("*.parquet")}
    assert visible == expected, f"missing parts {sorted(expected - visible)}, unexpected {sorted(visible - expected)}"
    row_ids = pq.read_table(results_dir(job_dir), columns=["row_id"]).column("row_id").to_pylist()
    assert sorted(row_ids) == list(range(manifest.num_rows)), "a row is missing or duplicated"


def write_rows(path: Path, count: int, image: Path | None = None, images_at: dict[int, Path] | None = None) -> Path:
    """A JSONL dataset of short chat rows; `image` for every row, `images_at` for some."""
    with open(path, "w") as out:
        for i in range(count):
            row: dict[str, object] = {"id": f"r{i}", "messages": [{"role": "user", "content": f"describe item {i}"}]}
            chosen = (images_at or {}).get(i, image)
            if chosen is not None:
                row["image"] = str(chosen)
            out.write(json.dumps(row) + "\n")
    return path


def submit(dataset: Path, model: Path | str, output: Path, broker: str, shard_size: int) -> tuple[Manifest, Path]:
    """Plan the job and queue its shards, as `vlmbatch submit --broker` does."""
    manifest, job_dir = plan_job(
        dataset, str(model), output, shard_size=shard_size, broker=broker, sampling=SamplingParams(max_tokens=2, temperature=0.0)
    )
    enqueue_job(manifest, job_dir, broker)
    return manifest, job_dir


def wait_state(job_dir: Path, broker: str, states: set[str], timeout: float) -> JobStatus:
    """Poll `job_status` until the job reaches one of `states` (Redis may be away meanwhile)."""

    def reached() -> JobStatus | None:
        try:
            status = job_status(job_dir, broker)
        except redis.RedisError:
            return None
        return status if status.state in states else None

    return wait_for(reached, timeout, f"job state in {sorted(states)}")  # type: ignore[return-value]


@contextmanager
def deliveries(server: RedisServer, timeout: float) -> Iterator[Callable[[int], None]]:
    """MONITOR `server` from here on: `wait(n)` returns the moment the n-th message since
    then is taken off a queue (kombu's HSET of it into `unacked`), i.e. just before the
    worker that took it makes the task's first Redis calls."""
    client = redis.Redis.from_url(server.url, socket_timeout=timeout)
    with client.monitor() as monitor:
        seen = 0

        def wait(n: int) -> None:
            nonlocal seen
            try:
                for command in monitor.listen():
                    seen += command["command"].startswith("HSET unacked ")
                    if seen >= n:
                        return
            except redis.TimeoutError:
                raise AssertionError(f"{seen} messages taken, waiting for the {n}th, none within {timeout:.0f} s") from None

        yield wait
    client.close()


def running_shards(job_dir: Path, broker: str) -> dict[int, str]:
    """Shard -> worker id of every shard running right now (from the live leases)."""
    manifest = Manifest.load(job_dir)
    store = JobStore(connect(broker), manifest.job_id)
    return store.lease_holders([s.shard_id for s in manifest.shards if not manifest.part_path(s.shard_id).exists()])


def assert_job_completed(job_dir: Path, broker: str) -> JobStatus:
    """The check every reliability test ends with."""
    assert_exactly_once(job_dir)
    status = job_status(job_dir, broker)
    assert status.state == "completed"
    assert status.rows_done == status.num_rows
    return status
