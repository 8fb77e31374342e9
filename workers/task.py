"""The shard task: run one shard of a job exactly once, whatever Celery delivers.

A message may arrive for a shard that is already committed (a redelivery after the part
landed), that another worker is running (visibility timeout, duplicate queueing), or for
a cancelled job. The committed part makes the task idempotent, the lease keeps two copies
from running at once, and every early stop that did not commit puts the message back:
when unsure, requeue (a duplicate costs a look at the folder; a lost message loses a shard).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vlmbatch.io.manifest import Manifest
from vlmbatch.job.parts import part_counts
from vlmbatch.job.shard import run_shard
from vlmbatch.workers import runtime
from vlmbatch.workers.lease import ShardLease
from vlmbatch.workers.poison import ShardStopped, run_guarded
from vlmbatch.workers.store import JobStore, advisory

log = logging.getLogger(__name__)

# How often a running shard looks at the job's cancel flag (one Redis GET each time).
CANCEL_POLL_SECONDS = 0.5
PROGRESS_SEND_SECONDS = 0.5
# How often a finished shard asks whether the broker is back.
BROKER_WAIT_SECONDS = 1.0


def run_shard_task(task: Any, job_dir: str, shard_id: int, retry_errors: bool = False) -> str:
    """Celery entry point (bound task); returns what happened, for the worker log.

    With `retry_errors` the shard's committed part is rewritten with its error rows re-run.
    """
    worker = runtime.current()
    try:
        return _run_delivered(task, job_dir, shard_id, retry_errors, worker)
    finally:
        _await_broker(worker)


def _run_delivered(task: Any, job_dir: str, shard_id: int, retry_errors: bool, worker: runtime.WorkerRuntime) -> str:
    from celery.exceptions import Reject

    manifest = Manifest.load(job_dir, worker.storage_options)  # a folder or an s3:// prefix
    store = JobStore(worker.redis, manifest.job_id)
    committed = manifest.part_path(shard_id).exists
    if committed() != retry_errors:
        return "already committed" if committed() else "no part to retry"
    try:
        if store.is_cancelled():
            store.set_shard_state(shard_id, "cancelled")
            return "cancelled"
        ttl = worker.queue.visibility_timeout
        delivery_tag = (task.request.properties or {}).get("delivery_tag")
        lease = ShardLease(worker.redis, store.lease_key(shard_id), worker.worker_id, ttl, delivery_tag)
        if not lease.acquire():
            # A live worker runs this shard. Acking this copy could drop the only message left
            # for the shard (a redelivered message shares its ack with the running one), so a
            # fresh copy is queued for later: it finds the part committed, or the lease expired.
            raise task.retry(countdown=ttl / 2, max_retries=None)
        with lease:
            if committed() != retry_errors:
                return "already committed" if committed() else "no part to retry"
            return _run_leased(manifest, shard_id, worker, store, lease, retry_errors)
    except Exception as exc:
        if not _stopped_early(exc):
            raise
        if _cancelled(store):
            store.set_shard_state(shard_id, "cancelled")
            return "cancelled"
        with advisory("record the requeue"):
            store.set_shard_state(shard_id, "queued")
        raise Reject(f"stopped before commit: {exc!r}", requeue=True)


def _stopped_early(exc: BaseException) -> bool:
    """A stop that is no fault of the shard: it goes back to the queue, it does not fail.

    Besides our own `ShardStopped` (cancel, warm shutdown, lease lost), that is a cold
    shutdown (SIGQUIT, a second Ctrl+C): Celery's solo pool cannot kill the task it runs,
    so it raises NotImplementedError inside it, after flagging `should_terminate`. Caught
    as a failure, the message would be acked and the shard lost.

    And a broker outage: Redis restarting (or still loading its append-only file), or out
    of reach, while the shard reads or writes its keys (the cancel flag, the lease, the
    attempt counter, the crash ledger: most of them as the shard starts, just after a
    delivery). As a failure, the message would be acked once Redis is back and the shard
    would never run: the job waits for it forever.
    """
    import redis
    from celery.worker import state as worker_state

    cold_shutdown = isinstance(exc, NotImplementedError) and worker_state.should_terminate is not None
    broker_away = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
    return isinstance(exc, ShardStopped) or cold_shutdown or broker_away


def _run_leased(
    manifest: Manifest,
    shard_id: int,
    worker: runtime.WorkerRuntime,
    store: JobStore,
    lease: ShardLease,
    retry_errors: bool,
) -> str:
    from celery.worker import state as worker_state

    job_dir = manifest.job_dir
    attempt = store.next_attempt(shard_id)
    store.start_attempt(shard_id)
    store.set_shard_state(shard_id, "running", worker=worker.worker_id, attempt=attempt)
    last_poll = 0.0
    cancelled = False

    def should_stop() -> bool:
        nonlocal last_poll, cancelled
        if lease.lost.is_set() or worker_state.should_stop is not None or worker_state.should_terminate is not None:
            return True
        if time.monotonic() - last_poll >= CANCEL_POLL_SECONDS:
            last_poll = time.monotonic()
            cancelled = _cancelled(store)
        return cancelled

    unsent = [0, 0]  # rows ok / failed not yet counted in Redis
    last_sent = 0.0

    def on_progress(ok: int, failed: int) -> None:
        # One Redis round trip per row would cost more than a cheap row itself: send the
        # counts at most every PROGRESS_SEND_SECONDS (the committed part sets them exactly).
        nonlocal last_sent
        unsent[0] += ok
        unsent[1] += failed
        if time.monotonic() - last_sent >= PROGRESS_SEND_SECONDS:
            last_sent = time.monotonic()
            with advisory("count rows"):
                store.add_rows(shard_id, *unsent)
            unsent[:] = [0, 0]

    metrics = worker.metrics
    options: dict[str, Any] = {"attempt": attempt, "should_stop": should_stop, "on_progress": on_progress,
                               "preparer": worker.preparer, "slot": worker.slot,
                               "on_row": metrics.row_finished if metrics is not None else None}
    if metrics is not None:
        metrics.shard_started()
    try:
        if retry_errors:
            if run_shard(manifest, job_dir, shard_id, worker.llm, retry_errors=True, **options).stopped:
                raise ShardStopped
        else:
            run_guarded(manifest, job_dir, shard_id, worker.llm, store, worker.queue.poison_crashes, **options)
    except Exception as exc:
        stopped = _stopped_early(exc)
        if metrics is not None:
            metrics.shard_ended("stopped" if stopped else "failed")
        if not stopped:
            with advisory("record the failed shard"):
                store.set_shard_state(shard_id, "failed", worker=worker.worker_id, error=f"{type(exc).__name__}: {exc}")
        raise
    if metrics is not None:
        metrics.shard_ended("committed")
    ok, failed = part_counts(manifest.part_path(shard_id))  # the part, not this run: exact
    with advisory("record the committed shard"):
        store.set_rows(shard_id, ok, failed)
        store.set_shard_state(shard_id, "done", worker=worker.worker_id, attempt=attempt)
    return f"committed {ok} ok, {failed} failed"


def _await_broker(worker: runtime.WorkerRuntime) -> None:
    """Return only once Redis answers, so that Celery's ack of this message gets through.

    A shard may end while the broker is away (restarting). Celery would then fail the ack,
    keep the message counted against the prefetch limit of 1, and never take another
    message after the broker is back (the worker sits idle, silently). Waiting here costs
    nothing: without a broker this process has nothing else to do.
    """
    import redis
    from celery.worker import state as worker_state

    while worker_state.should_terminate is None:
        try:
            worker.redis.ping()
            return
        except redis.RedisError as exc:
            log.warning("waiting for the broker before acknowledging the shard: %s", exc)
            time.sleep(BROKER_WAIT_SECONDS)


def _cancelled(store: JobStore) -> bool:
    """The cancel flag, read as "not cancelled" while Redis is unreachable."""
    import redis

    try:
        return store.is_cancelled()
    except redis.RedisError:
        return False
