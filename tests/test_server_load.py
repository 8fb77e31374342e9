"""200 concurrent clients (half streaming) through the `openai` client against a real server
process: every request succeeds, none is a 5xx, and the server's memory comes back to its
baseline once the load is gone; /health stays quick while the engine generates."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from vlmbatch.testing.server_process import ServerProcess

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


async def _load(url: str, model: str) -> Counter:
    """Run all clients at once; returns their outcomes."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        return Counter(await asyncio.gather(*(_one_client(client, model, i) for i in range(CLIENTS))))


def _health_while_the_engine_works(url: str) -> list[float]:
    """/health latencies while one long generation holds the engine (no other traffic)."""
    long = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    worker = threading.Thread(target=lambda: httpx.post(f"{url}/v1/chat/completions", json=long, timeout=300))
    worker.start()
    latencies = []
    while worker.is_alive() and len(latencies) < 20:
        started = time.perf_counter()
        in_flight = httpx.get(f"{url}/health", timeout=30).json()["requests_in_flight"]
        if in_flight:
            latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    worker.join(300)
    return latencies


def _settled_rss(server: ServerProcess) -> int:
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    return psutil.Process(server.process.pid).memory_info().rss


def test_200_concurrent_clients_no_5xx_and_memory_returns(server: ServerProcess, tiny_qwen: Path) -> None:
    model = str(tiny_qwen)
    assert asyncio.run(_load(server.url, model)) == Counter({"200": CLIENTS})  # warm-up
    baseline = _settled_rss(server)

    assert asyncio.run(_load(server.url, model)) == Counter({"200": CLIENTS})

    after = _settled_rss(server)
    assert after - baseline < RSS_SLACK_BYTES, f"RSS grew by {(after - baseline) / 2**20:.1f} MiB"
    assert httpx.get(f"{server.url}/health").json()["requests_in_flight"] == 0


def test_the_event_loop_answers_while_the_engine_generates(server: ServerProcess) -> None:
    """The engine runs in its own thread: a long generation does not hold up other routes."""
    latencies = _health_while_the_engine_works(server.url)
    assert len(latencies) >= 3, "the generation ended before /health could be probed"
    assert statistics.median(latencies) < 0.25, latencies
