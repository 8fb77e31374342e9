"""With a broker, commands find a job by its bare id wherever it was submitted to (submit
records its folder and manifest URL in Redis); a job nobody knows is refused with every
place that was looked at. Real redis-server, the real CLI in fresh processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import queue_harness as qh
from queue_harness import redis_server  # noqa: F401  (fixture)

from vlmbatch.workers.local import VLMBATCH
from vlmbatch.workers.store import JobStore

pytestmark = pytest.mark.slow


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLMBATCH, *args], capture_output=True, text=True, timeout=180, cwd=cwd, env=qh.worker_env())


def test_bare_job_ids_through_the_broker(tmp_path: Path, redis_server: qh.RedisServer, tiny_qwen: Path) -> None:
    dataset = qh.write_rows(tmp_path / "rows.jsonl", 6)
    output = tmp_path / "somewhere" / "out"
    submitted = cli("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output), "--broker",
                    redis_server.url, "--shard-size", "3", cwd=tmp_path)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    meta = redis_server.client().hgetall(JobStore(None, job_id).key("meta"))  # type: ignore[arg-type]
    assert meta[b"manifest"].decode() == f"{output / job_id}/manifest.json"

    elsewhere = tmp_path / "elsewhere"  # another working directory, no --output: only the broker knows
    elsewhere.mkdir()
    shown = cli("status", job_id, "--broker", redis_server.url, cwd=elsewhere)
    assert shown.returncode == 0, shown.stderr
    assert "queued" in shown.stdout and "0 / 6" in shown.stdout

    unknown = cli("cancel", "job-nobody-knows", "--broker", redis_server.url, cwd=elsewhere)
    assert unknown.returncode == 2
    message = " ".join(unknown.stderr.replace("│", " ").split())
    for place in ("job-nobody-knows/manifest.json", "vlmbatch-out/job-nobody-knows/manifest.json",
                  f"the broker {redis_server.url} (it has no job 'job-nobody-knows')"):  # fmt: skip
        assert place in message, message
