"""Prometheus metrics of `vlmbatch serve`, at `GET /metrics` (prometheus-client).

Each app has its own registry (two apps in one process, as in the tests, never share
counters). Request timings are taken where a request's outputs arrive on the event loop
(`AsyncEngine.generate`), so they are what a client sees minus the network; the engine's
load (running and waiting sequences, KV-cache use) is read at scrape time. docs/serve.md
lists every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmbatch.engine.base import EngineLoad

# Latency buckets (s): a tiny CPU model answers in milliseconds, a long GPU answer in minutes.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
# Paths counted under their own name; anything else is `other` (no label per probing URL).
KNOWN_PATHS = ("/v1/chat/completions", "/v1/models", "/health", "/version", "/metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineLoadCollector(Collector):
    """Gauges read from the engine when Prometheus scrapes."""

    def __init__(self, load: Callable[[], EngineLoad | None]):
        self.load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self.load()
        if load is None:  # the hf engine has no scheduler or paged cache
            return
        yield GaugeMetricFamily("vlmbatch_server_requests_running", "Sequences the engine is generating.", value=load.running)
        yield GaugeMetricFamily("vlmbatch_server_requests_waiting", "Sequences waiting to be admitted.", value=load.waiting)
        yield GaugeMetricFamily("vlmbatch_server_kv_cache_usage_ratio", "Share of the KV-cache blocks in use (0..1).",
                                value=load.kv_cache_usage)


class ServerMetrics:
    """The server's metrics and the timer of each request."""

    def __init__(self, load: Callable[[], EngineLoad | None]):
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmbatch_server_requests", "HTTP requests answered, by path and status code.",
                                ["path", "status"], registry=self.registry)
        self.latency = Histogram("vlmbatch_server_request_latency_seconds", "Chat completion time, arrival to last token.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("vlmbatch_server_time_to_first_token_seconds", "Arrival at the engine to the first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("vlmbatch_server_inter_token_latency_seconds", "Time between two tokens of one request.",
                                     buckets=TOKEN_GAP_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("vlmbatch_server_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("vlmbatch_server_generation_tokens", "Tokens generated for finished requests.",
                                         registry=self.registry)
        self.registry.register(_EngineLoadCollector(load))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's token timings, fed with its token count each time its output grows."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.started = time.perf_counter()
        self.last: float | None = None
        self.tokens = 0

    def progressed(self, tokens: int) -> None:
        new = tokens - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
            new -= 1  # the first token's gap is the TTFT
        if new > 0 and self.last is not None:
            gap = (now - self.last) / new  # tokens that arrived together share the step's time
            for _ in range(new):
                self.metrics.inter_token.observe(gap)
        self.last, self.tokens = now, tokens

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.metrics.latency.observe(time.perf_counter() - self.started)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)


class CountResponses:
    """ASGI middleware: every HTTP answer counted by path and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
