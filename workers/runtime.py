"""What a worker process loaded and was configured with at start-up, for the shard task.

Celery's solo pool runs tasks in the process that started the worker, so the model is
loaded once, before the first message is consumed, and every shard reuses it.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmbatch.config import EngineConfig, QueueConfig

if TYPE_CHECKING:
    import redis

    from vlmbatch.job.preparer import RowPreparer
    from vlmbatch.workers.metrics import WorkerMetrics


def new_worker_id(slot: str) -> str:
    """`host/slot/pid-xxxx`: readable in `status`, unique even when a pid is reused."""
    return f"{socket.gethostname()}/{slot}/{os.getpid()}-{uuid.uuid4().hex[:4]}"


def pid_of(worker_id: str) -> int:
    """The process id inside a worker id made by `new_worker_id`."""
    return int(worker_id.rsplit("/", 1)[1].split("-")[0])


@dataclass
class WorkerRuntime:
    model: str
    llm: Any | None  # None: a dry-run worker that validates rows and generates nothing
    redis: redis.Redis
    preparer: RowPreparer  # the preprocessing pool every shard of this process reuses
    engine: EngineConfig  # how `llm` runs (its GPU image decoding is every job's default)
    queue: QueueConfig  # leases and poison-row isolation
    slot: str = "cpu"  # the GPU this process is pinned to
    storage_options: dict[str, Any] = field(default_factory=dict)  # for s3:// job folders (over the AWS configuration)
    metrics: WorkerMetrics | None = None  # Prometheus metrics, when `--metrics-port` is set
    worker_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.worker_id = new_worker_id(self.slot)


_current: WorkerRuntime | None = None


def install(runtime: WorkerRuntime) -> None:
    global _current
    _current = runtime


def current() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError("no model loaded in this process: shard tasks run only inside `vlmbatch worker`")
    return _current
