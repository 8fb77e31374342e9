"""A job's live state in Redis: cancel flag, shard states, row counters, crash ledger.

Everything here is advisory except the cancel flag: the manifest plus the committed parts
in the output folder are the truth, so this state may be lost (Redis wiped) and rebuilt by
`vlmbatch resume`. Row counters are kept per shard and reset at each attempt, so a shard
that runs twice (crash, redelivery) is never counted twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

KEY_PREFIX = "vlmbatch"


def connect(url: str) -> redis.Redis:
    """A Redis client that fails fast instead of hanging when the server is gone."""
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10, socket_keepalive=True)


@contextmanager
def advisory(what: str) -> Iterator[None]:
    """Run a best-effort Redis update: a broker outage must not fail a shard over bookkeeping."""
    import redis

    try:
        yield
    except redis.RedisError as exc:
        log.warning("could not %s (Redis unavailable?): %s", what, exc)


@dataclass(frozen=True)
class RowRange:
    """Rows `[start, end)` of a job, in global row numbers (unique across shards)."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def key(self) -> str:
        return f"{self.start}-{self.end}"


class JobStore:
    """Redis keys of one job, under `vlmbatch:job:<job_id>:`."""

    def __init__(self, client: redis.Redis, job_id: str):
        self.client = client
        self.job_id = job_id

    def key(self, name: str) -> str:
        return f"{KEY_PREFIX}:job:{self.job_id}:{name}"

    def lease_key(self, shard_id: int) -> str:
        return f"{KEY_PREFIX}:lease:{self.job_id}:{shard_id}"

    # --- registration and cancel ---------------------------------------------------
    def register(self, job_dir: str, model: str, queue: str, num_shards: int, num_rows: int | None) -> None:
        """Record the job, with its folder and its manifest's URL: what lets every command
        find a job by its bare id (`job_dir`). `num_rows` is None for JSONL on object storage."""
        meta = {"job_dir": job_dir, "manifest": f"{job_dir.rstrip('/')}/manifest.json", "model": model, "queue": queue,
                "num_shards": num_shards}
        self.client.hset(self.key("meta"), mapping={**meta, **({} if num_rows is None else {"num_rows": num_rows})})

    def is_registered(self) -> bool:
        return bool(self.client.exists(self.key("meta")))

    def job_dir(self) -> str | None:
        """The job's folder (a path or a URL) as submit recorded it; None for a job this Redis does not know."""
        value = self.client.hget(self.key("meta"), "job_dir")
        return value.decode() if value is not None else None

    def cancel(self) -> None:
        self.client.set(self.key("cancel"), "1")

    def clear_cancel(self) -> None:
        self.client.delete(self.key("cancel"))

    def is_cancelled(self) -> bool:
        return bool(self.client.exists(self.key("cancel")))

    # --- shard states ----------------------------------------------------------------
    def set_shard_state(self, shard_id: int, state: str, **details: Any) -> None:
        record = {"state": state, "updated": time.time(), **details}
        self.client.hset(self.key("shards"), str(shard_id), json.dumps(record))

    def set_shard_states(self, shard_ids: list[int], state: str) -> None:
        if shard_ids:
            record = json.dumps({"state": state, "updated": time.time()})
            self.client.hset(self.key("shards"), mapping={str(s): record for s in shard_ids})

    def shard_states(self) -> dict[int, dict[str, Any]]:
        raw = self.client.hgetall(self.key("shards"))
        return {int(k): json.loads(v) for k, v in raw.items()}

    def next_attempt(self, shard_id: int) -> int:
        """1 for a shard's first run, then 2, 3...: the `attempt` result column."""
        return int(self.client.hincrby(self.key("attempts"), str(shard_id), 1))

    # --- row counters ----------------------------------------------------------------
    def start_attempt(self, shard_id: int) -> None:
        """Zero the shard's counters (a rerun recounts from scratch) and stamp the job start."""
        pipe = self.client.pipeline()
        pipe.hset(self.key("rows_ok"), str(shard_id), 0)
        pipe.hset(self.key("rows_failed"), str(shard_id), 0)
        pipe.set(self.key("started_at"), time.time(), nx=True)
        pipe.execute()

    def add_rows(self, shard_id: int, ok: int, failed: int) -> None:
        pipe = self.client.pipeline()
        pipe.hincrby(self.key("rows_ok"), str(shard_id), ok)
        pipe.hincrby(self.key("rows_failed"), str(shard_id), failed)
        pipe.execute()

    def set_rows(self, shard_id: int, ok: int, failed: int) -> None:
        pipe = self.client.pipeline()
        pipe.hset(self.key("rows_ok"), str(shard_id), ok)
        pipe.hset(self.key("rows_failed"), str(shard_id), failed)
        pipe.execute()

    def rows_by_shard(self) -> tuple[dict[int, int], dict[int, int]]:
        def ints(name: str) -> dict[int, int]:
            return {int(k): int(v) for k, v in self.client.hgetall(self.key(name)).items()}

        return ints("rows_ok"), ints("rows_failed")

    def started_at(self) -> float | None:
        value = self.client.get(self.key("started_at"))
        return float(value) if value is not None else None

    def lease_holders(self, shard_ids: list[int]) -> dict[int, str]:
        """Which worker holds each running shard's lease (only live leases appear)."""
        if not shard_ids:
            return {}
        values = self.client.mget([self.lease_key(s) for s in shard_ids])
        return {s: v.decode() for s, v in zip(shard_ids, values) if v is not None}

    # --- crash ledger ----------------------------------------------------------------
    def crashes(self, rows: RowRange) -> int:
        """Attempts at these rows that started and never ended: each one killed its process."""
        value = self.client.hget(self.key("crashes"), rows.key)
        return int(value or 0)

    @contextmanager
    def attempt(self, rows: RowRange) -> Iterator[None]:
        """Count an attempt as a crash until it ends; an attempt that ends, well or not, is none."""
        self.client.hincrby(self.key("crashes"), rows.key, 1)
        try:
            yield
        finally:
            with advisory("close the crash ledger entry"):
                self.client.hincrby(self.key("crashes"), rows.key, -1)
