"""Prometheus metrics of one `vlmbatch worker` GPU process, each on its own port
(`--metrics-port` plus the process's slot index: one scrape target per GPU).

Counters move as rows finish (the shard runner reports each result row), so a scrape
during a long shard sees its progress; the engine's KV-cache use and the preprocessing
pool's depth are read at scrape time. docs/queue.md lists every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from vlmbatch.engine.base import EngineLoad

# Shard durations (s): a few tiny rows on the CPU to thousands of rows on a GPU.
SHARD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


class _ScrapeTimeCollector(Collector):
    def __init__(self, load: Callable[[], EngineLoad | None], pool_depth: Callable[[], int]):
        self.load = load
        self.pool_depth = pool_depth

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self.load()
        if load is not None:  # the hf engine (and a dry run) has no paged KV cache
            yield GaugeMetricFamily("vlmbatch_worker_kv_cache_usage_ratio", "Share of the KV-cache blocks in use (0..1).",
                                    value=load.kv_cache_usage)
        yield GaugeMetricFamily("vlmbatch_worker_preprocess_queue_depth",
                                "Rows handed to the preprocessing pool and not yet prepared.", value=self.pool_depth())


class WorkerMetrics:
    """This process's metrics; `serve(port)` exposes them over HTTP."""

    def __init__(self, load: Callable[[], EngineLoad | None], pool_depth: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.rows_done = Counter("vlmbatch_worker_rows_done", "Rows generated without an error.", registry=self.registry)
        self.rows_failed = Counter("vlmbatch_worker_rows_failed", "Rows that ended in an error, by error_type.",
                                   ["error_type"], registry=self.registry)
        self.prompt_tokens = Counter("vlmbatch_worker_prompt_tokens", "Prompt tokens of finished rows.", registry=self.registry)
        self.generation_tokens = Counter("vlmbatch_worker_generation_tokens", "Tokens generated for finished rows.",
                                         registry=self.registry)
        self.shard_seconds = Histogram("vlmbatch_worker_shard_duration_seconds",
                                       "Shard run time, by outcome (committed, stopped, failed).", ["outcome"],
                                       buckets=SHARD_BUCKETS, registry=self.registry)
        self.rows_per_second = Gauge("vlmbatch_worker_rows_per_second", "Rows per second of the running (else the last) shard.",
                                     registry=self.registry)
        self.shards_running = Gauge("vlmbatch_worker_shards_running", "Shards this process is running (0 or 1).",
                                    registry=self.registry)
        self.registry.register(_ScrapeTimeCollector(load, pool_depth))
        self._shard_started = 0.0
        self._shard_rows = 0

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` from a daemon thread."""
        start_http_server(port, addr=address, registry=self.registry)

    def shard_started(self) -> None:
        self._shard_started, self._shard_rows = time.monotonic(), 0
        self.shards_running.set(1)

    def row_finished(self, row: dict[str, Any]) -> None:
        """One result row of the running shard (the shard runner's `on_row`)."""
        if row.get("error_type") is None:
            self.rows_done.inc()
        else:
            self.rows_failed.labels(str(row["error_type"])).inc()
        self.prompt_tokens.inc(row.get("num_input_tokens") or 0)
        self.generation_tokens.inc(row.get("num_generated_tokens") or 0)
        self._shard_rows += 1
        self.rows_per_second.set(self._shard_rows / max(time.monotonic() - self._shard_started, 1e-6))

    def shard_ended(self, outcome: str) -> None:
        self.shard_seconds.labels(outcome).observe(time.monotonic() - self._shard_started)
        self.shards_running.set(0)
