"""Real systems for the queue tests: a private redis-server, `vlmbatch worker` processes.

Nothing is mocked: Redis runs on a free port with an append-only file (so a `kill -9`
and restart keeps the queue), workers are the real command in subprocesses with a clean
environment, and they are killed with real signals.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import redis

from vlmbatch.io.manifest import Manifest, part_name, results_dir

VLMBATCH = str(Path(sys.executable).parent / "vlmbatch")  # the installed command itself
# Short enough that crash recovery fits in a test, long enough for a loaded 2-core CI box.
TEST_VISIBILITY_TIMEOUT = 4.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Poll `condition` until it is truthy; fail the test with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class RedisServer:
    """A redis-server with AOF in its own folder; can be killed and brought back on the same port."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        cmd += ["--appendonly", "yes", "--save", "", "--protected-mode", "no"]
        log = open(self.folder / "redis.log", "ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)

        def ping() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(ping, 20, "redis-server to answer")

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


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


class Worker:
    """One `vlmbatch worker` command (a supervisor with one CPU worker process)."""

    def __init__(self, model: str, broker: str, log_path: Path, env: dict[str, str], dry_run: bool = False):
        cmd = [VLMBATCH, "worker", "--model", model, "--broker", broker, "--gpus", "cpu"]
        cmd += ["--dry-run"] if dry_run else []
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def child(self) -> psutil.Process | None:
        """The Celery worker process the supervisor started (None between restarts)."""
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return None
        return children[0] if children else None

    def wait_child(self, timeout: float = 60) -> psutil.Process:
        return wait_for(self.child, timeout, "the worker process to start")  # type: ignore[return-value]

    def ready(self) -> bool:
        """Consuming: Celery logs `ready.` once the model is loaded and the queue declared."""
        return self.log_path.exists() and self.log_path.read_bytes().count(b" ready.") > 0

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                for proc in psutil.Process(self.process.pid).children(recursive=True):
                    proc.kill()
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """`start_worker(model, broker, dry_run=False, env=None)`; every worker is stopped at teardown."""
    started: list[Worker] = []

    def start(model: str, broker: str, dry_run: bool = False, env: dict[str, str] | None = None) -> Worker:
        worker = Worker(str(model), broker, tmp_path / f"worker-{len(started)}.log", worker_env(env), dry_run)
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
