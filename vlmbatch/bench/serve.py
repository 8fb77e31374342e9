"""`vlmbatch bench serve`: requests/s and p50/p99 latency of `vlmbatch serve` at several
numbers of concurrent clients (closed loop: `vlmbatch.bench.loadgen`); prints a table and
writes JSON (see BENCHMARKS.md and docs/serve.md)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import platform
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _image_data_url(side: int) -> str:
    """A small synthetic PNG (a gradient, so it is not trivially compressible) as a data: URL."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    pixels = np.stack([np.tile(ramp, (side, 1)), np.tile(ramp[:, None], (1, side)), np.full((side, side), 128, np.uint8)], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _body_factory(max_tokens: int, image_side: int, stream: bool):
    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe the picture in one sentence."}]
    if image_side:
        content.insert(0, {"type": "image_url", "image_url": {"url": _image_data_url(image_side)}})

    def make_body(i: int) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every request costs exactly max_tokens
            "stream": stream and i % 2 == 1,  # with --stream, every other request streams
        }

    return make_body


def run(model: str | None, shape: str | None, url: str | None, engine: str, api_key: str | None, levels: list[int],
        requests_per_level: int, max_tokens: int, image_side: int, stream: bool, output: Path) -> None:
    """Start a server for `model` (or random weights of `shape`, written under `output`'s
    folder) or use the one at `url`; measure each concurrency level in `levels`."""
    from vlmbatch.bench.loadgen import run_load
    from vlmbatch.bench.shapes import resolve_shape, save_random_checkpoint
    from vlmbatch.testing.server_process import ServerProcess

    if shape is not None:
        model = str(save_random_checkpoint(resolve_shape(shape), output.parent))
    make_body = _body_factory(max_tokens, image_side, stream)
    server = None
    if model is not None:
        args = ["--model", model, "--engine", engine, "--log-level", "warning"]
        server = ServerProcess(args + (["--api-key", api_key] if api_key else [])).start()
        url = server.url
    assert url is not None
    results = []
    try:
        asyncio.run(run_load(url, make_body, concurrency=1, total_requests=2, api_key=api_key))  # warm-up
        for clients in levels:
            total = requests_per_level or max(32, 2 * clients)
            results.append(asyncio.run(run_load(url, make_body, clients, total, api_key=api_key)).to_dict())
    finally:
        if server is not None:
            server.stop()

    table = Table(title=f"vlmbatch serve: {model or url}")
    for column in ("clients", "requests", "ok", "req/s", "p50 ms", "p99 ms", "statuses"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r["concurrency"]), str(r["requests"]), str(r["succeeded"]), f"{r['requests_per_s']:.2f}",
            f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}", json.dumps(r["statuses"]),
        )
    Console().print(table)
    report = {
        "benchmark": "serve",
        "model": model,
        "shape": shape,
        "url": url if server is None else None,
        "engine": engine if server is not None else None,
        "max_tokens": max_tokens,
        "image_side": image_side,
        "stream_half": stream,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "levels": results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    Console(stderr=True).print(f"wrote {output}")
