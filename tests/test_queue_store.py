"""Leases, the crash ledger and per-shard counters against a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import time

import queue_harness as qh
from queue_harness import redis_server  # noqa: F401  (fixture)

from vlmbatch.workers.lease import UNACKED_INDEX_KEY, ShardLease
from vlmbatch.workers.store import JobStore, RowRange


def test_lease_excludes_a_second_worker_while_its_heartbeat_runs(redis_server: qh.RedisServer) -> None:
    client = redis_server.client()
    holder = ShardLease(client, "vlmbatch:lease:j:0", "worker-a", ttl=0.8, delivery_tag=None)
    rival = ShardLease(client, "vlmbatch:lease:j:0", "worker-b", ttl=0.8, delivery_tag=None)
    assert holder.acquire()
    with holder:
        time.sleep(2.0)  # 2.5 TTLs: only the heartbeat keeps the lease alive
        assert not rival.acquire()
        assert rival.holder() == "worker-a"
    assert holder.holder() is None  # released on exit, no TTL wait for the next worker
    assert rival.acquire()


def test_lease_of_a_dead_worker_expires(redis_server: qh.RedisServer) -> None:
    client = redis_server.client()
    assert ShardLease(client, "vlmbatch:lease:j:1", "dead", ttl=0.5, delivery_tag=None).acquire()  # no heartbeat
    rival = ShardLease(client, "vlmbatch:lease:j:1", "alive", ttl=0.5, delivery_tag=None)
    assert not rival.acquire()
    time.sleep(0.7)
    assert rival.acquire()


def test_heartbeat_renews_the_message_visibility(redis_server: qh.RedisServer) -> None:
    client = redis_server.client()
    client.zadd(UNACKED_INDEX_KEY, {"tag-1": time.time() - 100, "tag-2": time.time() - 100})
    lease = ShardLease(client, "vlmbatch:lease:j:2", "w", ttl=0.4, delivery_tag="tag-1")
    assert lease.acquire()
    with lease:
        time.sleep(0.3)
    assert client.zscore(UNACKED_INDEX_KEY, "tag-1") > time.time() - 5  # ours renewed
    assert client.zscore(UNACKED_INDEX_KEY, "tag-2") < time.time() - 50  # others untouched


def test_crash_ledger_counts_only_attempts_that_never_ended(redis_server: qh.RedisServer) -> None:
    store = JobStore(redis_server.client(), "j")
    rows = RowRange(10, 20)
    try:
        with store.attempt(rows):
            raise ValueError("a Python error ends the attempt: not a crash")
    except ValueError:
        pass
    assert store.crashes(rows) == 0
    crash = (
        "import os; from vlmbatch.workers.store import JobStore, RowRange, connect\n"
        f"store = JobStore(connect({redis_server.url!r}), 'j')\n"
        "with store.attempt(RowRange(10, 20)):\n    os._exit(9)\n"
    )
    for _ in range(2):
        assert subprocess.run([sys.executable, "-c", crash]).returncode == 9
    assert store.crashes(rows) == 2
    assert store.crashes(RowRange(10, 15)) == 0


def test_row_counters_restart_with_each_attempt(redis_server: qh.RedisServer) -> None:
    store = JobStore(redis_server.client(), "j")
    store.start_attempt(3)
    store.add_rows(3, 5, 1)
    store.start_attempt(3)  # the shard runs again after a crash: its rows are not counted twice
    store.add_rows(3, 2, 0)
    store.set_rows(4, 7, 0)
    assert store.rows_by_shard() == ({3: 2, 4: 7}, {3: 0, 4: 0})
    assert store.next_attempt(3) == 1 and store.next_attempt(3) == 2
