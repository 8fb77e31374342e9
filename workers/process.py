"""One worker process: load the model, then consume shards of its queue one at a time.

Started by `vlmbatch worker` (supervisor.py), one per GPU, already pinned with
`CUDA_VISIBLE_DEVICES`. It uses Celery's solo pool: the task runs in this process, next
to the model loaded here before the first message is taken. The prefork pool would load
it in a child instead, where `worker_proc_alive_timeout` (4 s) kills slow model loads in
a restart loop, and a shard would cross a process boundary for nothing.

Its configuration comes on its command line (`ProcessConfigs`: `vlmbatch worker` built it
from its flags and `VLMBATCH_*` variables); only its share of the cores comes in its
environment, next to `CUDA_VISIBLE_DEVICES`, from the supervisor.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, replace

from vlmbatch.config import EngineConfig, MediaConfig, QueueConfig, WorkerConfig, from_json, to_json
from vlmbatch.lifeline import die_with_parent
from vlmbatch.workers import runtime
from vlmbatch.workers.app import make_app, queue_name
from vlmbatch.workers.store import connect


@dataclass(frozen=True)
class ProcessConfigs:
    """Everything one worker process is configured with, passed as JSON on its command line."""

    engine: EngineConfig
    media: MediaConfig
    queue: QueueConfig
    worker: WorkerConfig

    FLAGS = {"engine": "--engine-config", "media": "--media-config", "queue": "--queue-config", "worker": "--worker-config"}

    def to_args(self, metrics_port: int | None = None) -> list[str]:
        """`--engine-config JSON ...` of one process, whose metrics port is `metrics_port`.
        Left out: the share of the cores, which the supervisor gives each process through
        `VLMBATCH_WORKER_CPUS` (see `pinned_env`), and the storage options, which may hold
        credentials and so travel in the environment (`VLMBATCH_STORAGE_OPTIONS`), not on a
        command line that `ps` shows."""
        worker = replace(self.worker, worker_cpus=None, storage_options=None, metrics_port=metrics_port)
        configs = {"engine": self.engine, "media": self.media, "queue": self.queue, "worker": worker}
        return [arg for name, flag in self.FLAGS.items() for arg in (flag, to_json(configs[name]))]

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> ProcessConfigs:
        """The configurations `to_args` wrote; what they left unset (the core share, the
        storage options) comes from `env`."""
        kinds = {"engine": EngineConfig, "media": MediaConfig, "queue": QueueConfig, "worker": WorkerConfig}
        return cls(**{name: from_json(kind, getattr(args, f"{name}_config"), env) for name, kind in kinds.items()})


def serve(model: str, broker_url: str, slot: str, dry_run: bool, configs: ProcessConfigs) -> int:
    """Run until shut down; returns Celery's exit code."""
    from vlmbatch.job.preparer import AdapterSpec, RowPreparer
    from vlmbatch.media.video import default_video_options, prepare_video_backend

    logging.basicConfig(level=logging.INFO, format=f"[{slot} %(asctime)s %(levelname)s %(name)s] %(message)s")
    prepare_video_backend(default_video_options(configs.media))
    preparer = RowPreparer(configs.worker, configs.media)  # one preprocessing pool for every shard this process runs
    llm = None
    if not dry_run:
        from vlmbatch.job.plan import load_llm

        preparer.start_fork_server()  # its imports overlap the model load
        llm = load_llm(model, configs.engine)
    try:
        preparer.start(AdapterSpec(model) if llm is not None else None)
        runtime.install(runtime.WorkerRuntime(model, llm, connect(broker_url), preparer, configs.engine, configs.queue,
                                              slot, configs.worker.storage_options or {},
                                              serve_metrics(configs.worker.metrics_port, llm, preparer)))
        app = make_app(broker_url, configs.queue)
        celery_worker = app.Worker(
            hostname=f"vlmbatch-{slot}-{os.getpid()}@{socket.gethostname()}",
            queues=[queue_name(model)],
            pool_cls="solo",
            concurrency=1,
            # Workers share nothing but Redis and the folder: skipping mingle/gossip saves a
            # second of start-up and a broadcast per worker.
            without_mingle=True,
            without_gossip=True,
            loglevel="INFO",
        )
        celery_worker.start()
    finally:
        preparer.close()
    return int(celery_worker.exitcode or 0)


def serve_metrics(port: int | None, llm: Any | None, preparer: Any) -> Any | None:
    """This process's Prometheus endpoint on `port` (None: no metrics)."""
    if port is None:
        return None
    from vlmbatch.workers.metrics import WorkerMetrics

    metrics = WorkerMetrics(lambda: llm.engine.load() if llm is not None else None,
                            lambda: preparer.pool.in_flight if preparer.pool is not None else 0)
    metrics.serve(port)
    logging.getLogger(__name__).info("metrics on port %d", port)
    return metrics


def pin_to_share(worker: WorkerConfig) -> None:
    """Run on the cores `vlmbatch worker` gave this process, before torch starts its thread
    pools (sized from the affinity) and the preprocessing pool forks (it inherits it)."""
    allowed = (worker.worker_cpus or set()) & os.sched_getaffinity(0)
    if allowed and worker.pin_worker_cpus:
        os.sched_setaffinity(0, allowed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One vlmbatch worker process (started by `vlmbatch worker`).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--broker", required=True)
    parser.add_argument("--slot", default="cpu", help="GPU index this process is pinned to, or 'cpu'")
    parser.add_argument("--supervisor-pid", type=int, default=None,
                        help="the `vlmbatch worker` that started this process: it exits when that one dies")
    parser.add_argument("--dry-run", action="store_true", help="validate rows without a model (queue benchmark)")
    for name, flag in ProcessConfigs.FLAGS.items():
        parser.add_argument(flag, default="{}", help=f"this process's {name} configuration (JSON; unset options: the environment)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.supervisor_pid is not None:  # first: an orphan must not load a model (or take a shard)
        die_with_parent(args.supervisor_pid)
    configs = ProcessConfigs.from_args(args, os.environ)
    pin_to_share(configs.worker)
    code = serve(args.model, args.broker, args.slot, args.dry_run, configs)
    # Everything that matters is already in the folder and in Redis; tearing down a loaded
    # model at interpreter exit is seconds of garbage collection, so skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
