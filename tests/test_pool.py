"""The preprocessing process pool: out-of-order delivery, back-pressure, crash recovery, shutdown.

The workers are real processes (fork server), the crashes real `os._exit`s; the handlers
below stand in for `prepare_row` so that each property is tested in isolation and fast.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vlmbatch.errors import ErrorType
from vlmbatch.job.process_pool import PoolStartError, ProcessPool, Task


def _echo_setup(slow_every: int) -> Callable[[Task], Any]:
    """Rows whose id is a multiple of `slow_every` take 0.3 s, the others are instant."""

    def handle(task: Task) -> tuple[int, Any, int]:
        row_id, payload = task
        if row_id % slow_every == 0:
            time.sleep(0.3)
        return row_id, payload, os.getpid()

    return handle


def _size_setup(_: None) -> Callable[[Task], Any]:
    """Returns only the payload's size, so the parent holds nothing of what it sent."""
    return lambda task: (task[0], len(task[1]))


def _misbehaving_setup(_: None) -> Callable[[Task], Any]:
    """Dies like a segfaulting decoder on a "crash" row, hangs on a "hang" row, raises on a "raise" row."""

    def handle(task: Task) -> tuple[int, Any, int]:
        row_id, payload = task
        if payload == "crash":
            os._exit(11)
        if payload == "hang":
            time.sleep(600)
        if payload == "raise":
            raise ValueError("bad row")
        return row_id, payload, os.getpid()

    return handle


def _failing_setup(_: None) -> Callable[[Task], Any]:
    raise OSError("model folder vanished")


def _failure(task: Task, error_type: str, message: str) -> tuple[int, str, str]:
    return task[0], error_type, message


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_out_of_order_completion_keeps_every_result_with_its_row() -> None:
    rows = [(row_id, f"payload-{row_id}") for row_id in range(24)]
    with ProcessPool(_echo_setup, 6, _failure, num_workers=2, max_pending=8) as pool:
        results = list(pool.imap_unordered(rows))
    order = [row_id for row_id, _, _ in results]
    assert sorted(order) == list(range(24))
    assert order != sorted(order)  # slow rows were overtaken
    assert all(payload == f"payload-{row_id}" for row_id, payload, _ in results)
    assert len({pid for _, _, pid in results}) == 2  # both workers took rows


@pytest.mark.timeout(120)  # an unbounded pool would read the endless source forever
def test_source_is_only_read_when_there_is_room() -> None:
    pulled = 0
    payload = b"x" * 1_000_000  # a 1 MB row: 400 of them kept anywhere would show in RSS

    def endless() -> Iterator[Task]:
        nonlocal pulled
        for row_id in itertools.count():
            pulled += 1
            yield row_id, bytes(payload)

    with ProcessPool(_size_setup, None, _failure, num_workers=2, max_pending=6) as pool:
        results = pool.imap_unordered(endless())
        rss_after_warmup = 0
        for consumed, (_, size) in enumerate(results, start=1):
            assert size == len(payload)
            assert pulled - consumed <= 6  # never more than max_pending rows ahead
            assert pool.in_flight <= 4  # two per worker
            time.sleep(0.002)  # a consumer slower than the source
            if consumed == 50:
                rss_after_warmup = _rss_bytes()
            if consumed == 400:
                break
        results.close()
    assert _rss_bytes() - rss_after_warmup < 50_000_000


def test_a_worker_crash_fails_only_its_row_and_the_pool_recovers() -> None:
    rows = [(row_id, "crash" if row_id == 3 else "raise" if row_id == 5 else "ok") for row_id in range(12)]
    with ProcessPool(_misbehaving_setup, None, _failure, num_workers=2, max_pending=8) as pool:
        results = {result[0]: result for result in pool.imap_unordered(rows)}
        restarts = pool.restarts
    assert sorted(results) == list(range(12))
    assert results[3][1] == ErrorType.WORKER_CRASH and "exit code 11" in results[3][2]
    assert results[5][1:] == (ErrorType.ENGINE, "ValueError: bad row")
    assert all(results[row_id][1] == "ok" for row_id in range(12) if row_id not in (3, 5))
    assert restarts == 1  # the exception did not cost a worker, the crash cost one


def test_a_hung_row_times_out_and_its_worker_is_replaced() -> None:
    rows = [(row_id, "hang" if row_id == 2 else "ok") for row_id in range(10)]
    with ProcessPool(_misbehaving_setup, None, _failure, num_workers=2, task_timeout=2.0) as pool:
        start = time.monotonic()
        results = {result[0]: result for result in pool.imap_unordered(rows)}
        elapsed, restarts = time.monotonic() - start, pool.restarts
    assert results[2][1:] == (ErrorType.MEDIA_TIMEOUT, "preparing this row took over 2 s")
    assert all(results[row_id][1] == "ok" for row_id in range(10) if row_id != 2)
    assert restarts == 1 and elapsed < 30


def test_a_setup_failure_stops_the_pool_with_the_reason() -> None:
    with pytest.raises(PoolStartError, match="model folder vanished"):
        with ProcessPool(_failing_setup, None, _failure, num_workers=1) as pool:
            list(pool.imap_unordered([(0, "ok")]))


def _pool_results(rows: list[Task]) -> Iterator[tuple[int, Any, int]]:
    with ProcessPool(_echo_setup, 1, _failure, num_workers=2, max_pending=4) as pool:
        yield from pool.imap_unordered(rows)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by init does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_dropping_the_iterator_stops_the_workers() -> None:
    results = _pool_results([(row_id, None) for row_id in range(1, 100)])  # every row slow
    pids = {next(results)[2], next(results)[2], next(results)[2]}
    assert all(_alive(pid) for pid in pids)
    del results
    gc.collect()
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_workers_exit_when_the_owner_is_killed(busy: bool) -> None:
    """Idle workers, and workers busy with a row that never ends, leave within seconds of a
    `kill -9` of their owner, and so does the fork server (`vlmbatch.lifeline`)."""
    owner = textwrap.dedent(f"""
        import os, signal, sys
        import psutil
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pool import _echo_setup, _failure, _misbehaving_setup
        from vlmbatch.job.process_pool import ProcessPool

        pool = ProcessPool(_misbehaving_setup, None, _failure, num_workers=2).__enter__()
        results = pool.imap_unordered([(1, "ok"), (2, "hang"), (3, "hang"), (4, "ok")] if {busy} else [(1, "ok")])
        next(results)
        print(*(p.pid for p in psutil.Process().children(recursive=True)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.run([sys.executable, "-c", owner], capture_output=True, text=True, timeout=120)
    pids = [int(pid) for pid in run.stdout.split()]
    # the two workers, the fork server and the resource tracker
    assert run.returncode == -9 and len(pids) >= 4, run.stderr
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)]
