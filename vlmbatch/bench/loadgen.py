"""Closed-loop load against a chat endpoint: N clients, each sending its next request when
the previous one is answered. Measures requests/s and latency percentiles, and counts
answers by status class so a benchmark can also prove that nothing failed."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class LoadResult:
    concurrency: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)  # "200", "400", "5xx"..., "transport"

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies_s) / self.wall_s if self.wall_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000) if self.latencies_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "succeeded": len(self.latencies_s),
            "statuses": dict(self.statuses),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests_per_s, 3),
            "p50_ms": round(self.percentile_ms(50), 1),
            "p99_ms": round(self.percentile_ms(99), 1),
        }


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    """POST one chat completion; a streamed one is read to its end. Returns the status."""
    if not body.get("stream"):
        response = await client.post("/v1/chat/completions", json=body)
        return response.status_code
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                break
        return response.status_code


async def run_load(
    base_url: str,
    make_body: Callable[[int], dict[str, Any]],
    concurrency: int,
    total_requests: int,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> LoadResult:
    """Send `total_requests` bodies (`make_body(i)`) from `concurrency` concurrent clients."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    next_index = iter(range(total_requests))
    result = LoadResult(concurrency=concurrency, wall_s=0.0)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout_s) as client:

        async def client_loop() -> None:
            for i in next_index:  # a shared iterator: each index is taken by exactly one client
                started = time.perf_counter()
                try:
                    status = await _send(client, make_body(i))
                except httpx.TransportError:
                    result.statuses["transport"] += 1
                    continue
                result.statuses[str(status)] += 1
                if status == 200:
                    result.latencies_s.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - started
    return result
