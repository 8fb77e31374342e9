"""An in-process job (the embedded default, no broker) stopped by Ctrl-C keeps its committed
shards: `vlmbatch status` reads them from the folder, `vlmbatch resume` runs the rest in
its own process with the engine options `submit` was given, and `resume --retry-errors`
re-runs only the rows that failed, once their input is fixed. `wait` explains that such a
job has no queue to follow."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from PIL import Image
from typer.testing import CliRunner

from test_submit_e2e import qwen_prompt, vlmbatch
from vlmbatch.cli.commands import app

ROWS, SHARD_SIZE = 240, 20


def _interrupted_job(dataset: Path, model: Path, output: Path) -> tuple[str, str]:
    """Start `submit` in-process and Ctrl-C it once two shards are committed: (job id, its stderr)."""
    submit = subprocess.Popen(
        [sys.executable, "-m", "vlmbatch.cli", "submit", str(dataset), "--model", str(model), "--output", str(output),
         "--shard-size", str(SHARD_SIZE), "--max-tokens", "8", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while len(list(output.glob("*/results/*.parquet"))) < 2:
        assert submit.poll() is None and time.monotonic() < deadline, "no two committed shards"
        time.sleep(0.05)
    submit.send_signal(signal.SIGINT)
    stdout, stderr = submit.communicate(timeout=120)
    assert submit.returncode == 130, stderr[-2000:]
    return stdout.split()[0], stderr


def test_an_interrupted_in_process_job_resumes_here_and_retries_its_failed_rows(tiny_qwen: Path, tmp_path: Path) -> None:
    rows = [{"id": "late-image", "prompt": qwen_prompt("What is it?"), "image": "img/late.png"}]  # its file comes later
    rows += [{"id": f"r{i}", "prompt": qwen_prompt(f"Say {i}.", images=0)} for i in range(1, ROWS)]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out"

    job_id, stderr = _interrupted_job(dataset, tiny_qwen, output)
    assert f"vlmbatch resume {job_id}" in stderr
    job_dir = output / job_id
    parts = {path.name: path.stat().st_mtime_ns for path in (job_dir / "results").glob("*.parquet")}
    assert 2 <= len(parts) < ROWS // SHARD_SIZE
    assert json.loads((job_dir / "manifest.json").read_text())["extra"]["engine_flags"]["dtype"] == "float32"

    cli = CliRunner()  # the commands that load no model, in this process
    status = cli.invoke(app, ["status", job_id, "--output", str(output)], terminal_width=200)
    assert status.exit_code == 0 and f"{ROWS // SHARD_SIZE - len(parts)} shards left" in status.output, status.output
    waited = cli.invoke(app, ["wait", job_id, "--output", str(output)], terminal_width=200)
    assert waited.exit_code == 2 and "ran in-process" in waited.output

    resumed = vlmbatch("resume", job_id, "--output", str(output))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    table = pq.read_table(job_dir / "results")
    assert sorted(table.column("row_id").to_pylist()) == list(range(ROWS))
    assert all((job_dir / "results" / name).stat().st_mtime_ns == mtime for name, mtime in parts.items())  # not run again
    errors = {r["id"]: r["error_type"] for r in table.to_pylist() if r["error_type"] is not None}
    assert errors == {"late-image": "media_not_found"}

    (tmp_path / "img").mkdir()
    Image.new("RGB", (64, 48), "blue").save(tmp_path / "img/late.png")
    retried = vlmbatch("resume", job_id, "--output", str(output), "--retry-errors")
    assert retried.returncode == 0, retried.stderr[-3000:]
    table = pq.read_table(job_dir / "results")
    assert sorted(table.column("row_id").to_pylist()) == list(range(ROWS))
    assert table.column("error_type").null_count == ROWS
    assert next(r for r in table.to_pylist() if r["id"] == "late-image")["num_input_tokens"] > 20  # its image is in the prompt now
