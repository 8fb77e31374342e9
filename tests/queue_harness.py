"""Real systems for the queue tests: a private redis-server, `vlmbatch worker` processes.

Nothing is mocked: Redis runs on a free port with an append-only file (so a `kill -9`
and restart keeps the queue), workers are the real command in subprocesses with a clean
environment, and they are killed with real signals.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vlmbatch.io.manifest import Manifest, part_name, results_dir
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
