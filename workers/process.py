"""One worker process: load the model, then consume shards of its queue one at a time.

Started by `vlmbatch worker` (supervisor.py), one per GPU, already pinned with
`CUDA_VISIBLE_DEVICES`. It uses Celery's solo pool: the task runs in this process, next
to the model loaded here before the first message is taken. The prefork pool would load
it in a child instead, where `worker_proc_alive_timeout` (4 s) kills slow model loads in
a restart loop, and a shard would cross a process boundary for nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

from vlmbatch.config import EngineConfig, MediaConfig, QueueConfig, WorkerConfig
from vlmbatch.workers import runtime
from vlmbatch.workers.app import make_app, queue_name
from vlmbatch.workers.store import connect


def serve(model: str, broker_url: str, slot: str, dry_run: bool, engine: EngineConfig, media: MediaConfig,
          queue: QueueConfig, worker: WorkerConfig) -> int:
    """Run until shut down; returns Celery's exit code."""
    from vlmbatch.job.preparer import AdapterSpec, RowPreparer
    from vlmbatch.media.video import default_video_options, prepare_video_backend

    logging.basicConfig(level=logging.INFO, format=f"[{slot} %(asctime)s %(levelname)s %(name)s] %(message)s")
    prepare_video_backend(default_video_options(media))
    preparer = RowPreparer(worker, media)  # one preprocessing pool for every shard this process runs
    llm = None
    if not dry_run:
        from vlmbatch.job.plan import load_llm

        preparer.start_fork_server()  # its imports overlap the model load
        llm = load_llm(model, engine)
    try:
        preparer.start(AdapterSpec(model) if llm is not None else None)
        runtime.install(runtime.WorkerRuntime(model, llm, connect(broker_url), preparer, engine, queue, slot))
        app = make_app(broker_url, queue)
        worker = app.Worker(
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
        worker.start()
    finally:
        preparer.close()
    return int(worker.exitcode or 0)


def pin_to_share(worker: WorkerConfig) -> None:
    """Run on the cores `vlmbatch worker` gave this process, before torch starts its thread
    pools (sized from the affinity) and the preprocessing pool forks (it inherits it)."""
    allowed = (worker.worker_cpus or set()) & os.sched_getaffinity(0)
    if allowed and worker.pin_worker_cpus:
        os.sched_setaffinity(0, allowed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One vlmbatch worker process (started by `vlmbatch worker`).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--broker", required=True)
    parser.add_argument("--slot", default="cpu", help="GPU index this process is pinned to, or 'cpu'")
    parser.add_argument("--engine", default="auto", help="paged, hf or auto (the worker's engine serves every job)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dry-run", action="store_true", help="validate rows without a model (queue benchmark)")
    parser.add_argument("--media-io-kwargs", default="{}", help="this worker's media defaults (JSON), e.g. its video decoder")
    args = parser.parse_args(argv)
    worker = WorkerConfig.from_env(os.environ)
    pin_to_share(worker)
    engine = EngineConfig.from_env(os.environ, engine=args.engine, dtype=args.dtype)
    media = MediaConfig.from_env(os.environ, video_options=json.loads(args.media_io_kwargs).get("video"))
    code = serve(args.model, args.broker, args.slot, args.dry_run, engine, media, QueueConfig.from_env(os.environ), worker)
    # Everything that matters is already in the folder and in Redis; tearing down a loaded
    # model at interpreter exit is seconds of garbage collection, so skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
