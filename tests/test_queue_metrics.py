"""A real `vlmbatch worker` with `VLMBATCH_METRICS_PORT` (the `--metrics-port` variable),
scraped over HTTP while its job runs and after; Celery's task events, as Flower receives
them, from the same run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pyarrow.parquet as pq
import queue_harness as qh
from prometheus_client.parser import text_string_to_metric_families
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)

from vlmbatch.config import QueueConfig
from vlmbatch.workers.app import SHARD_TASK, make_app
from vlmbatch.workers.local import free_port


def scrape(port: int) -> dict[tuple[str, frozenset], float] | None:
    """(name, labels) → value, parsed by prometheus-client's own parser; None while not up."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return None
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


@contextmanager
def captured_events(broker: str) -> Iterator[list[dict]]:
    """Every Celery event on the broker while the block runs, as Flower's receiver gets them."""
    app = make_app(broker, QueueConfig())
    events: list[dict] = []
    with app.connection() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": events.append})
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        thread.start()
        try:
            yield events
        finally:
            receiver.should_stop = True  # before Redis goes away at teardown
            thread.join(10)


def run_job_with_metrics(tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path, port: int,
                         events: list[dict]) -> Path:
    """A 300-row job (two failing rows) on one worker, scraped mid-job; returns its folder."""
    missing = tmp_path / "missing.png"  # two rows fail with media_not_found
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 300, images_at={3: missing, 170: missing})
    start_worker(tiny_qwen, redis_server.url, env={"VLMBATCH_METRICS_PORT": str(port)})
    qh.wait_for(lambda: any(e["type"] == "worker-heartbeat" for e in events), 120, "the worker's heartbeat event")
    manifest, job_dir = qh.submit(dataset, tiny_qwen, tmp_path / "out", redis_server.url, shard_size=50)

    def mid_job() -> dict | None:
        metrics = scrape(port)
        running = metrics and metrics.get(("vlmbatch_worker_shards_running", frozenset()), 0) == 1
        return metrics if running and metrics.get(("vlmbatch_worker_rows_done_total", frozenset()), 0) > 0 else None

    during = qh.wait_for(mid_job, 120, "a scrape showing a shard in progress")
    assert during[("vlmbatch_worker_rows_per_second", frozenset())] > 0
    assert ("vlmbatch_worker_preprocess_queue_depth", frozenset()) in during
    assert 0 <= during[("vlmbatch_worker_kv_cache_usage_ratio", frozenset())] <= 1  # the paged engine's cache
    qh.wait_state(job_dir, redis_server.url, {"completed"}, timeout=180)
    qh.assert_job_completed(job_dir, redis_server.url)
    return job_dir


def test_worker_metrics_over_http_during_a_job_and_task_events(
    tmp_path: Path, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    port = free_port()
    with captured_events(redis_server.url) as events:
        job_dir = run_job_with_metrics(tmp_path, redis_server, start_worker, tiny_qwen, port, events)
    after = scrape(port)
    assert after is not None
    results = pq.read_table(job_dir / "results")
    assert after[("vlmbatch_worker_rows_done_total", frozenset())] == 298
    assert after[("vlmbatch_worker_rows_failed_total", frozenset({("error_type", "media_not_found")}))] == 2
    assert after[("vlmbatch_worker_generation_tokens_total", frozenset())] == pc.sum(results["num_generated_tokens"]).as_py()
    assert after[("vlmbatch_worker_shard_duration_seconds_count", frozenset({("outcome", "committed")}))] == 6
    assert after[("vlmbatch_worker_shards_running", frozenset())] == 0

    shard_events = [e for e in events if e.get("name") == SHARD_TASK or e["type"].startswith("task-")]
    kinds = [e["type"] for e in shard_events]
    assert kinds.count("task-sent") == 6 and kinds.count("task-succeeded") == 6, sorted(set(kinds))
