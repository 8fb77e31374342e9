"""A shard's lease: the one worker allowed to run it, kept alive by a heartbeat thread.

Celery on Redis can deliver a message twice: when a shard outlives the visibility timeout
(kombu never renews it), or when the same shard is queued twice (resume after a cancel).
The lease is a Redis key per shard holding the worker's id with a TTL (`SET NX PX`, via
redis-py's `Lock`); a second copy that finds it held does not run the shard. While the
shard runs, the heartbeat renews both the lease and the message's visibility, so a live
worker's shard is not handed out again; a killed worker stops renewing, and both expire.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

from vlmbatch.workers.store import advisory

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

# kombu's Redis transport keeps each delivered, unacked message's delivery time in this
# sorted set (transport option `unacked_index_key`) and redelivers those older than the
# visibility timeout; moving our message's score to "now" is how a running shard renews it.
UNACKED_INDEX_KEY = "unacked_index"


class ShardLease:
    """Exclusive right to run one shard; `lost` is set if another worker took it over."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl: float, delivery_tag: str | None):
        self.client = client
        self.token = token
        self.ttl = ttl
        self.delivery_tag = delivery_tag
        self.lost = threading.Event()
        self._lock = client.lock(key, timeout=ttl, blocking=False, thread_local=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        """Take the lease if nobody holds it (or we already do, after a Redis restart)."""
        if self.client.get(self._lock.name) == self.token.encode():
            return True
        return bool(self._lock.acquire(token=self.token))

    def holder(self) -> str | None:
        value = self.client.get(self._lock.name)
        return value.decode() if value is not None else None

    def __enter__(self) -> ShardLease:
        self._thread = threading.Thread(target=self._heartbeat, name="vlmbatch-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with advisory("release the shard lease"):
            if self.holder() == self.token:
                self._lock.release()

    def _heartbeat(self) -> None:
        """Renew every quarter TTL; keep trying through broker outages, give up only if taken."""
        import redis

        while not self._stop.wait(self.ttl / 4):
            try:
                self._renew()
            except redis.RedisError as exc:
                log.warning("lease heartbeat failed (Redis unavailable?): %s", exc)

    def _renew(self) -> None:
        holder = self.holder()
        if holder is None:
            # Expired during a broker outage and nobody took it: take it back.
            if not self.acquire():
                holder = self.holder()
        if holder not in (None, self.token):
            log.error("lease taken over by %s; stopping this copy of the shard", holder)
            self.lost.set()
            self._stop.set()
            return
        self._lock.reacquire()
        if self.delivery_tag is not None:
            self.client.zadd(UNACKED_INDEX_KEY, {self.delivery_tag: time.time()}, xx=True)
