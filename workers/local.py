"""A queue on this machine: a private redis-server and `vlmbatch worker` processes.

For the reliability tests and `vlmbatch bench queue`, which need the real pieces (a
Redis with an append-only file that survives `kill -9`, worker commands that can be
signalled and killed) started and stopped on demand.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

VLMBATCH = str(Path(sys.executable).parent / "vlmbatch")  # the installed command itself


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll `condition` until it returns something truthy, which is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class RedisServer:
    """redis-server on a free port with AOF in `folder`; `kill9` then `start` keeps its data."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        cmd += ["--appendonly", "yes", "--save", "", "--protected-mode", "no"]
        with open(self.folder / "redis.log", "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self.answers, 20, "redis-server to answer")

    def answers(self) -> bool:
        import redis

        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_connect_timeout=2)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


class WorkerCommand:
    """One `vlmbatch worker` (a supervisor and its single CPU worker process)."""

    def __init__(self, model: str, broker: str, log_path: Path, env: dict[str, str], dry_run: bool = False):
        cmd = [VLMBATCH, "worker", "--model", model, "--broker", broker, "--gpus", "cpu"]
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(cmd + (["--dry-run"] if dry_run else []), env=env, stdout=log, stderr=subprocess.STDOUT)

    def child(self) -> psutil.Process | None:
        """The Celery worker process (None between a crash and its restart)."""
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return None
        return children[0] if children else None

    def ready_count(self) -> int:
        """How many times a worker process of this command began consuming (Celery logs `ready.`)."""
        return self.log_path.read_bytes().count(b" ready.") if self.log_path.exists() else 0

    def stop(self, timeout: float = 30) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                for proc in psutil.Process(self.process.pid).children(recursive=True):
                    proc.kill()
                self.process.kill()
                self.process.wait()
