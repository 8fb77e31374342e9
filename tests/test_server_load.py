"""200 concurrent clients (half streaming) through the `openai` client against a real server
process: every request succeeds, none is a 5xx, /health stays quick, and the server's
memory comes back to its baseline once the load is gone."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from vlmbatch.server.launcher import ServerProcess

CLIENTS = 200
MAX_TOKENS = 4
# Allocator slack: after a warm-up round of the same load, a leak of even a few KB per
# request (200 requests, several rounds) would exceed this.
RSS_SLACK_BYTES = 40 * 1024**2


@pytest.fixture(scope="module")
def server(tiny_qwen: Path):
    with ServerProcess(["--model", str(tiny_qwen), "--log-level", "warning"]) as process:
        yield process


async def _one_client(client: openai.AsyncOpenAI, model: str, i: int) -> str:
    messages = [{"role": "user", "content": f"Client {i} says hello"}]
    try:
        if i % 2:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            finishes = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
            return "200" if len(finishes) == 1 else "bad-stream"
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return "200" if reply.usage.completion_tokens >= 1 else "bad-usage"
    except openai.APIStatusError as error:
        return str(error.status_code)
    except openai.APIConnectionError:
        return "connection"


async def _load(url: str, model: str) -> tuple[Counter, list[float]]:
    """Run all clients at once while timing /health every 0.2 s."""
    health_latencies: list[float] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        load = asyncio.gather(*(_one_client(client, model, i) for i in range(CLIENTS)))
        async with httpx.AsyncClient() as probe:
            while not load.done():
                started = time.perf_counter()
                assert (await probe.get(f"{url}/health", timeout=30)).status_code == 200
                health_latencies.append(time.perf_counter() - started)
                await asyncio.wait({load}, timeout=0.2)
        return Counter(await load), health_latencies


def _settled_rss(server: ServerProcess) -> int:
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    return psutil.Process(server.process.pid).memory_info().rss


def test_200_concurrent_clients_no_5xx_and_memory_returns(server: ServerProcess, tiny_qwen: Path) -> None:
    model = str(tiny_qwen)
    warmup, _ = asyncio.run(_load(server.url, model))
    assert warmup == Counter({"200": CLIENTS})
    baseline = _settled_rss(server)

    statuses, health_latencies = asyncio.run(_load(server.url, model))
    assert statuses == Counter({"200": CLIENTS})
    # The engine runs in its own thread, so the event loop keeps answering while it works; the
    # median (not the max) because the first probe queues behind the 200 arriving requests.
    assert len(health_latencies) >= 5 and statistics.median(health_latencies) < 0.25, health_latencies

    after = _settled_rss(server)
    assert after - baseline < RSS_SLACK_BYTES, f"RSS grew by {(after - baseline) / 2**20:.1f} MiB"
    assert httpx.get(f"{server.url}/health").json()["requests_in_flight"] == 0
