"""Shared by the family tests that run a family everywhere the others work: a folder of
media files (a short video, an odd-sized image, a corrupt PNG), a job over rows through the
CLI (dry run, then the real run, results read back with DuckDB), and a served model with
its chat parts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from engine_harness import make_image


def load_family(arch: str, tiny_model_dir) -> tuple[str, Any, Any]:
    """(arch, adapter, fp32 transformers model on the CPU) of a tiny checkpoint, with one
    torch thread (the parity tests compare token for token, other tests share the cores)."""
    import torch

    from vlmbatch.engine.loading import load_hf_model
    from vlmbatch.families.registry import load_adapter

    torch.set_num_threads(1)
    path = str(tiny_model_dir(arch))
    return arch, load_adapter(path), load_hf_model(path, torch.float32, torch.device("cpu"))


def make_media_folder(folder: Path) -> Path:
    """`h264_mp4.mp4` (3 s, 96x64, 8 fps), `odd.png` (97x61) and `corrupt.png` in `folder`."""
    from vlmbatch.testing.videos import ffmpeg_available, make_video as make_video_file

    if not ffmpeg_available():
        pytest.skip("needs ffmpeg to make the test video")
    make_video_file(folder, "h264_mp4", width=96, height=64, fps=8, seconds=3)
    make_image(1, (97, 61)).save(folder / "odd.png")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
    return folder


def run_job(rows: list[dict[str, Any]], model: str, tmp_path: Path, dry_run_error: str) -> dict[str, dict[str, Any]]:
    """The rows as a JSONL dataset: its dry run must fail naming `dry_run_error`, its job
    (4 tokens a row) must complete; returns the result rows by id."""
    import duckdb
    from test_submit_e2e import vlmbatch

    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dry = vlmbatch("submit", str(dataset), "--model", model, "--dry-run", env={"VLMBATCH_PREPROCESS_WORKERS": "0"})
    assert dry.returncode == 1 and dry_run_error in dry.stdout + dry.stderr, dry.stderr[-2000:]
    done = vlmbatch("submit", str(dataset), "--model", model, "--output", str(tmp_path / "out"), "--max-tokens", "4",
                    env={"VLMBATCH_PREPROCESS_WORKERS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = tmp_path / "out" / done.stdout.split()[0] / "results"
    return {r["id"]: r for r in duckdb.sql(f"select * from read_parquet('{results}/*.parquet')").arrow().read_all().to_pylist()}


def media_parts(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(an image part as a data URL, a video part as a file URL) of `make_media_folder`'s files."""
    from server_harness import data_url

    image = {"type": "image_url", "image_url": {"url": data_url((folder / "odd.png").read_bytes())}}
    video = {"type": "video_url", "video_url": {"url": f"file://{folder / 'h264_mp4.mp4'}"}}
    return image, video


def ask(client: Any, model: str, *parts: dict[str, Any], **extra: Any) -> Any:
    """A 3-token greedy chat completion on `parts` and a question (`extra`: more request keys)."""
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}],
        max_tokens=3, temperature=0, **extra,
    )


@contextmanager
def served_client(model: str, folder: Path) -> Iterator[Any]:
    """An `openai` client of `vlmbatch serve` on `model`, allowed `folder`'s files, 4 frames a video."""
    import openai

    from vlmbatch.testing.server_process import ServerProcess

    args = ["--model", model, "--allowed-local-media-path", str(folder), "--media-io-kwargs", '{"video": {"num_frames": 4}}']
    with ServerProcess(args) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
