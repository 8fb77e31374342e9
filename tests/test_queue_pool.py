"""A `vlmbatch worker` process keeps one preprocessing pool for its life, started once its
model is loaded, and takes it with it however it ends: SIGTERM, SIGQUIT, or `kill -9`."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
import queue_harness as qh
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)



def _pool_processes(worker: qh.WorkerCommand) -> list[psutil.Process]:
    """The worker process's descendants once a pool worker (a child of its fork server) runs."""
    child = worker.child()
    if child is None:
        return []
    try:
        descendants = child.children(recursive=True)
        pool_started = any(p.ppid() != child.pid for p in descendants)
    except psutil.NoSuchProcess:
        return []
    return descendants if pool_started else []


@pytest.mark.parametrize("how", [pytest.param("SIGTERM", marks=pytest.mark.slow), pytest.param("SIGQUIT", marks=pytest.mark.slow), "SIGKILL"])
def test_the_pool_ends_with_its_worker_process(how: str, tmp_path: Path, redis_server: qh.RedisServer,
                                               start_worker, tiny_qwen: Path) -> None:
    worker = start_worker(tiny_qwen, redis_server.url)
    pool = qh.wait_for(lambda: _pool_processes(worker), 120, "the preprocessing pool to start with the worker")
    if how == "SIGKILL":
        worker.child().kill()  # the worker process alone; `vlmbatch worker` starts another
    else:
        worker.process.send_signal(getattr(signal, how))  # forwarded once to the worker process
        assert worker.process.wait(30) == 0
    deadline = time.monotonic() + 20
    while any(map(_alive, pool)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p.pid for p in pool if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
