"""`vlmbatch bench serve`: requests/s and p50/p99 latency of `vlmbatch serve` at several
numbers of concurrent clients; prints a table and writes JSON (see BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import platform
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from vlmbatch.cli.options import EngineOption


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


def _random_checkpoint(shape: str, workdir: Path) -> Path:
    """A Qwen2.5-VL checkpoint of real sizes with random weights (tiny tokenizer and
    processor), written once under `workdir` and reused by later runs."""
    import torch

    from vlmbatch.engine.bench import random_model

    path = workdir / f"qwen2_5_vl-{shape}"
    done = path / ".complete"
    if not done.exists():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _, model = random_model(shape, workdir, torch.bfloat16, device)
        model.save_pretrained(path)
        done.touch()
    return path


def bench_serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Start `vlmbatch serve` with this model for the run."),
    shape: Optional[str] = typer.Option(
        None, "--shape", help="Instead of --model: Qwen2.5-VL sizes with random weights (3b, 7b, tiny), written under bench-out/."
    ),
    url: Optional[str] = typer.Option(None, "--url", help="Measure an already running server instead (e.g. http://127.0.0.1:2242)."),
    engine: str = EngineOption,
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VLMBATCH_API_KEY", help="Bearer key of the server."),
    concurrency: str = typer.Option("1,16,200", "--concurrency", help="Comma-separated numbers of concurrent clients."),
    requests_per_level: int = typer.Option(0, "--requests", help="Requests per level (default: max(32, 2 x clients))."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Tokens generated per request."),
    image_side: int = typer.Option(64, "--image-side", min=0, help="Side of the PNG sent with each request; 0 sends text only."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream every other request."),
    output: Path = typer.Option(Path("bench-out/serve.json"), "--output", "-o", help="JSON results file."),
) -> None:
    """Closed-loop load: each client sends its next request when the previous one is answered."""
    from vlmbatch.testing.server_process import ServerProcess
    from vlmbatch.server.loadgen import run_load

    if sum(x is not None for x in (model, shape, url)) != 1:
        raise typer.BadParameter("give exactly one of --model or --shape (start a server) and --url (use a running one)")
    if shape is not None:
        model = str(_random_checkpoint(shape, output.parent))
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
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


def register(bench_app: typer.Typer) -> None:
    bench_app.command("serve")(bench_serve)
