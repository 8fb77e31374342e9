"""`vlmbatch bench queue`: what the queue costs, and how fast it recovers from a crash.

Both figures use workers that validate rows without generating (`--dry-run` workers), so
they measure Celery + Redis + the shard runner and nothing of the model:
- throughput: rows/s through the queue with N workers against the in-process runner on
  the same dataset, with each worker's RSS at the start and end (it should stay flat);
- recovery: seconds from `kill -9` of the worker running a shard to that shard running
  again on another worker.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _dataset(path: Path, rows: int) -> Path:
    line = '{"id": "%d", "prompt": "USER: describe row %d\\nASSISTANT:"}\n'
    with open(path, "w") as out:
        out.writelines(line % (i, i) for i in range(rows))
    return path


def _in_process(dataset: Path, model: str, output: Path, shard_size: int, env: dict[str, str]) -> float:
    from vlmbatch import job as jobs
    from vlmbatch.config import MediaConfig, WorkerConfig
    from vlmbatch.job.preparer import RowPreparer

    manifest, job_dir = jobs.plan_job(dataset, model, output, shard_size=shard_size)
    with RowPreparer(WorkerConfig.from_env(env), MediaConfig.from_env(env)) as preparer:
        return manifest.num_rows / jobs.run_job_locally(manifest, job_dir, None, preparer, show_progress=False)


def _through_queue(dataset: Path, model: str, output: Path, shard_size: int, broker: str, workers: list[Any]) -> dict[str, Any]:
    from vlmbatch import job as jobs
    from vlmbatch.job.parts import committed_shards
    from vlmbatch.job.queue import enqueue_job
    from vlmbatch.workers.local import wait_until

    manifest, job_dir = jobs.plan_job(dataset, model, output, shard_size=shard_size, broker=broker)
    rss_start = [w.child().memory_info().rss for w in workers]
    rss_peak = list(rss_start)
    started = time.perf_counter()
    enqueue_job(manifest, job_dir, broker)

    def finished() -> bool:
        for i, worker in enumerate(workers):
            rss_peak[i] = max(rss_peak[i], worker.child().memory_info().rss)
        return len(committed_shards(manifest)) == manifest.num_shards

    wait_until(finished, 24 * 3600, "the queued job to finish", interval=0.5)
    elapsed = time.perf_counter() - started
    rss_end = [w.child().memory_info().rss for w in workers]
    mib = 1 << 20
    return {
        "rows_per_s": manifest.num_rows / elapsed,
        "rss_start_mib": [r / mib for r in rss_start],
        "rss_peak_mib": [r / mib for r in rss_peak],
        "rss_end_mib": [r / mib for r in rss_end],
    }


def _recovery_seconds(dataset: Path, model: str, output: Path, shard_size: int, broker: str, workers: list[Any]) -> float:
    """Kill -9 the worker running a shard; time until another worker holds that shard's lease."""
    from vlmbatch import job as jobs
    from vlmbatch.job.queue import enqueue_job
    from vlmbatch.workers.local import wait_until
    from vlmbatch.workers.runtime import pid_of
    from vlmbatch.workers.store import JobStore, connect

    manifest, job_dir = jobs.plan_job(dataset, model, output, shard_size=shard_size, broker=broker)
    store = JobStore(connect(broker), manifest.job_id)
    enqueue_job(manifest, job_dir, broker)
    all_shards = [s.shard_id for s in manifest.shards]
    shard_id, holder = wait_until(lambda: next(iter(store.lease_holders(all_shards).items()), None), 600, "a running shard")
    os.kill(pid_of(holder), 9)
    killed = time.perf_counter()

    def taken_over() -> bool:
        now = store.lease_holders([shard_id]).get(shard_id)
        return now is not None and now != holder or manifest.part_path(shard_id).exists()

    wait_until(taken_over, 600, "the killed worker's shard to run again", interval=0.1)
    return time.perf_counter() - killed


def run(rows: int, shard_size: int, workers: int, broker: str | None, json_out: Path, env: dict[str, str]) -> None:
    """The command: both figures with `workers` dry-run workers (started with `env`) on a
    private redis-server (or `broker`); prints a table and writes `json_out`."""
    from vlmbatch.testing.tiny import make_tiny_model
    from vlmbatch.workers.local import RedisServer, WorkerCommand, wait_until

    console = Console()
    with tempfile.TemporaryDirectory(prefix="vlmbatch-bench-queue-") as tmp:
        root = Path(tmp)
        model = str(make_tiny_model(root / "model", "qwen2_5_vl"))
        dataset = _dataset(root / "rows.jsonl", rows)
        server = None
        if broker is None:
            (root / "redis").mkdir()
            server = RedisServer(root / "redis")
            server.start()
            broker = server.url
        started = [WorkerCommand(model, broker, root / f"worker-{i}.log", env, dry_run=True) for i in range(workers)]
        try:
            wait_until(lambda: all(w.ready_count() for w in started), 300, "the workers to start")
            local_rate = _in_process(dataset, model, root / "out", shard_size, env)
            queued = _through_queue(dataset, model, root / "out", shard_size, broker, started)
            recovery = _recovery_seconds(dataset, model, root / "out", shard_size * 4, broker, started)
        finally:
            for worker in started:
                worker.stop()
            if server is not None:
                server.stop()

    figures = {
        "rows": rows,
        "shard_size": shard_size,
        "workers": workers,
        "in_process_rows_per_s": local_rate,
        "queue_rows_per_s": queued["rows_per_s"],
        "queue_vs_in_process": queued["rows_per_s"] / local_rate,
        "worker_rss_start_mib": queued["rss_start_mib"],
        "worker_rss_peak_mib": queued["rss_peak_mib"],
        "worker_rss_end_mib": queued["rss_end_mib"],
        "kill9_to_rerun_s": recovery,
    }
    table = Table(title=f"queue overhead: {rows:,} rows, shards of {shard_size:,}, {workers} workers (no model work)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("in-process rows/s", f"{local_rate:,.0f}")
    table.add_row(f"queue rows/s ({workers} workers)", f"{queued['rows_per_s']:,.0f}")
    table.add_row("queue / in-process", f"{figures['queue_vs_in_process']:.2f}")
    for i in range(workers):
        rss = f"{queued['rss_start_mib'][i]:.0f} → {queued['rss_peak_mib'][i]:.0f} → {queued['rss_end_mib'][i]:.0f}"
        table.add_row(f"worker {i} RSS MiB (start → peak → end)", rss)
    table.add_row("kill -9 → shard running again", f"{recovery:.1f} s")
    console.print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(figures, indent=2))
    console.print(f"wrote {json_out}")
