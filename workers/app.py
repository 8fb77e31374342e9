"""The Celery application: one task (run a shard), configured for long GPU work.

Celery's defaults suit short tasks that may be retried freely. A shard is minutes of GPU
time whose result must land exactly once, so nearly every default that matters is changed
here, each with the reason. Celery and kombu are imported inside `make_app` so that the
client side of the package works where they are not installed.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from vlmbatch.config import QueueConfig

if TYPE_CHECKING:
    from celery import Celery

SHARD_TASK = "vlmbatch.run_shard"


def queue_name(model: str) -> str:
    """The queue that only workers of `model` consume: `vlmbatch.<readable part>-<hash>`.

    The hash of the full model string keeps two models whose sanitised names collide
    (`org/m` and `org_m`, or long paths) on different queues; submit and worker must
    therefore spell the model the same way.
    """
    spelled = model.rstrip("/")
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", spelled.split("/")[-1])[:48]
    digest = hashlib.sha1(spelled.encode()).hexdigest()[:8]
    return f"vlmbatch.{readable}-{digest}"


def make_app(broker_url: str, queue: QueueConfig) -> Celery:
    """A Celery app on `broker_url` (Redis) with the shard task registered; `queue` holds
    the delivery settings (they matter to the workers that consume, not to a client)."""
    from celery import Celery

    from vlmbatch.workers.task import run_shard_task

    visibility_timeout = queue.visibility_timeout
    app = Celery("vlmbatch", broker=broker_url, set_as_current=False)
    app.conf.update(
        # Ack a shard's message only when the task returns, i.e. after its part is
        # committed: a worker that dies mid-shard leaves the message to be delivered again.
        task_acks_late=True,
        # With the prefork pool a child killed by SIGKILL/OOM would otherwise count as
        # "done" and its shard would be lost (measured). Our workers use the solo pool,
        # where the visibility timeout below does this job; kept for prefork users.
        task_reject_on_worker_lost=True,
        # One shard per process at a time: with acks_late the running shard already fills
        # the prefetch slot, so no shard waits behind a long one on a busy worker.
        worker_prefetch_multiplier=1,
        # The message is just (job_dir, shard_id): JSON keeps it readable from any client
        # and never unpickles anything taken from the broker.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # Results live in the output folder and progress in our own Redis keys, so no
        # result backend (it would only grow Redis).
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        broker_transport_options={
            # A message not acked within this many seconds is given to another worker. A
            # running shard renews it (see lease.py), so this is the time a `kill -9`-ed
            # worker's shard waits before it runs again, not a limit on shard length.
            "visibility_timeout": visibility_timeout,
            # Sweep for such abandoned messages every second (kombu's default is every
            # 10 × 10 s, which adds ~100 s to every crash recovery).
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A broker on another machine that vanishes without closing TCP must still
            # surface as a connection error, or the worker would wait on it forever.
            "socket_keepalive": True,
        },
        # Redis may restart (or be restored from its AOF) while workers run: keep retrying
        # instead of exiting, both at start-up and after a lost connection.
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # A shard that is running when the broker connection drops keeps running: its part
        # is committed to the folder anyway, and the redelivered message then finds the part
        # and returns at once. Cancelling it would throw the work away.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # Task events (received, started, succeeded, failed, retried, and "sent" from the
        # client) and worker heartbeats, so Flower (or `celery events`) shows the workers and
        # their shards: a handful of small messages per shard, nothing next to its minutes.
        worker_send_task_events=True,
        task_send_sent_event=True,
        # Jobs are controlled through our own Redis keys, not Celery's broadcast commands;
        # without the pidbox (a pub/sub consumer) a warm shutdown ends in well under a second.
        worker_enable_remote_control=False,
        # Shards are never rate limited; the check only costs time per message.
        worker_disable_rate_limits=True,
    )
    app.task(
        bind=True,
        name=SHARD_TASK,
        acks_late=True,
        reject_on_worker_lost=True,
        ignore_result=True,
    )(run_shard_task)
    return app
