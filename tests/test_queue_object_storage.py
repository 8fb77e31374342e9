"""The queue's reliability suite again, with the dataset and the job folder on a real S3
server (SeaweedFS) and real `vlmbatch worker` processes that share no folder with the
client: duplicate delivery, `kill -9` of a worker mid-shard, cancel and resume, a poison
row, `resume --retry-errors`; every row exactly once. Commands name the job by its bare id
only (the broker knows where it lies)."""

from __future__ import annotations

import base64
import io
import json
import random
import subprocess
import uuid
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import queue_harness as qh
from PIL import Image
from queue_harness import redis_server, start_worker  # noqa: F401  (fixtures)
from s3_harness import S3Endpoint
from test_queue_crashes import POISON_SITECUSTOMIZE

from vlmbatch.errors import ErrorType
from vlmbatch.io.manifest import Manifest, part_name
from vlmbatch.job.queue import enqueue_job, job_status
from vlmbatch.workers.local import VLMBATCH
from vlmbatch.workers.runtime import pid_of

pytestmark = pytest.mark.slow


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a user on another machine runs it: no shared folder, only the URLs."""
    return subprocess.run([VLMBATCH, *args], capture_output=True, text=True, timeout=180, env=qh.worker_env(env))


def png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, "white").save(buffer, format="PNG")
    return buffer.getvalue()


def put(s3: S3Endpoint, key: str, data: bytes) -> str:
    with s3.arrow_fs().open_output_stream(f"{s3.bucket}/{key}") as out:
        out.write(data)
    return f"s3://{s3.bucket}/{key}"


def assert_exactly_once_on_s3(s3: S3Endpoint, manifest: Manifest, expected_ids: list[int]) -> pa.Table:
    """Every part there, nothing else under results/, and every row once (read where they lie)."""
    fs = s3.arrow_fs()
    results = f"{manifest.job_dir.path}/results"
    names = {info.base_name for info in fs.get_file_info(pa.fs.FileSelector(results))}
    assert names == {part_name(s.shard_id, manifest.num_shards) for s in manifest.shards}
    table = pq.read_table(results, filesystem=fs)
    assert sorted(table.column("row_id").to_pylist()) == expected_ids, "a row is missing or duplicated"
    return table


def test_queued_parquet_job_on_s3_survives_duplicates_kill9_and_cancel(
    tmp_path: Path, s3_server: S3Endpoint, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    prefix = f"queue-{uuid.uuid4().hex[:8]}"
    count = 600
    table = pa.table({"id": [f"r{i}" for i in range(count)], "prompt": ["<|im_start|>user\nhi<|im_end|>\n"] * count})
    local = tmp_path / "rows.parquet"
    pq.write_table(table, local, row_group_size=50)
    dataset = put(s3_server, f"{prefix}/rows.parquet", local.read_bytes())
    options = json.dumps(s3_server.storage_options())
    # The workers get the store through VLMBATCH_STORAGE_OPTIONS (the flag's variable).
    workers = [start_worker(tiny_qwen, redis_server.url, env={"VLMBATCH_STORAGE_OPTIONS": options}) for _ in range(2)]

    submitted = cli("submit", dataset, "--model", str(tiny_qwen), "--output", f"s3://{s3_server.bucket}/{prefix}/out",
                    "--broker", redis_server.url, "--storage-options", options, "--shard-size", "50", "--max-tokens", "2")
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.split()[0]
    manifest = Manifest.load(f"s3://{s3_server.bucket}/{prefix}/out/{job_id}", s3_server.storage_options())
    enqueue_job(manifest, manifest.job_dir, redis_server.url)  # every shard delivered twice

    holders = qh.wait_for(lambda: qh.running_shards(manifest.job_dir, redis_server.url), 120, "a shard to be running")
    psutil.Process(pid_of(random.Random(0).choice(sorted(holders.values())))).kill()  # mid-shard
    cancel = cli("cancel", job_id, "--broker", redis_server.url, "--storage-options", options)
    assert cancel.returncode == 0, cancel.stderr
    cancelled = qh.wait_state(manifest.job_dir, redis_server.url, {"cancelled", "completed"}, timeout=60)
    shown = cli("status", job_id, "--broker", redis_server.url, "--storage-options", options)
    assert shown.returncode == 0 and cancelled.state in shown.stdout, shown.stdout + shown.stderr

    assert cli("resume", job_id, "--broker", redis_server.url, "--storage-options", options).returncode == 0
    waited = cli("wait", job_id, "--broker", redis_server.url, "--storage-options", options)
    assert waited.returncode == 0, waited.stderr[-2000:]
    result = assert_exactly_once_on_s3(s3_server, manifest, list(range(count)))
    assert result.column("error_type").null_count == count
    for worker in workers:
        qh.wait_for(worker.child, 30, "the killed worker process to be restarted")

    merged = tmp_path / "merged.parquet"
    merge = cli("results", job_id, "--broker", redis_server.url, "--storage-options", options, "--merge", str(merged))
    assert merge.returncode == 0, merge.stderr
    assert pq.read_table(merged).column("row_id").to_pylist() == list(range(count))


def test_poison_row_and_retry_errors_on_s3_jsonl(
    tmp_path: Path, s3_server: S3Endpoint, redis_server: qh.RedisServer, start_worker, tiny_qwen: Path
) -> None:
    """JSONL on S3 (row ids are byte offsets); the workers use the standard AWS variables."""
    prefix = f"queue-{uuid.uuid4().hex[:8]}"
    fine = "data:image/png;base64," + base64.b64encode(png((32, 32))).decode()
    poison = "data:image/png;base64," + base64.b64encode(png((13, 17))).decode()
    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"item {i}"}],
                         "image": poison if i == 5 else fine}).encode() + b"\n" for i in range(12)]  # fmt: skip
    offsets = [sum(len(line) for line in lines[:i]) for i in range(len(lines))]
    dataset = put(s3_server, f"{prefix}/rows.jsonl", b"".join(lines))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISON_SITECUSTOMIZE)
    aws = {**s3_server.env(), "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    poisoned = [start_worker(tiny_qwen, redis_server.url, env={**aws, "PYTHONPATH": str(site)}) for _ in range(2)]

    submitted = cli("submit", dataset, "--model", str(tiny_qwen), "--output", f"s3://{s3_server.bucket}/{prefix}/out",
                    "--broker", redis_server.url, "--shard-size", "4", "--max-tokens", "2", env=aws)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.split()[0]
    manifest = Manifest.load(f"s3://{s3_server.bucket}/{prefix}/out/{job_id}", s3_server.storage_options())
    status = qh.wait_state(manifest.job_dir, redis_server.url, {"completed"}, timeout=180)
    assert status.rows_failed == 1 and status.num_rows is None  # JSONL on object storage: counted as read
    rows = {r["row_id"]: r for r in assert_exactly_once_on_s3(s3_server, manifest, offsets).to_pylist()}
    assert rows[offsets[5]]["error_type"] == ErrorType.WORKER_CRASH and rows[offsets[5]]["id"] == "r5"

    for worker in poisoned:  # the decoder is fixed: a healthy worker retries the error row
        worker.stop()
    start_worker(tiny_qwen, redis_server.url, env=aws)
    assert cli("resume", job_id, "--retry-errors", "--broker", redis_server.url, env=aws).returncode == 0

    def retried() -> bool:
        status = job_status(manifest.job_dir, redis_server.url)
        return status.state == "completed" and status.rows_failed == 0

    qh.wait_for(retried, 120, "the poison row to be retried")
    rows = {r["row_id"]: r for r in assert_exactly_once_on_s3(s3_server, manifest, offsets).to_pylist()}
    assert rows[offsets[5]]["error_type"] is None and rows[offsets[5]]["num_generated_tokens"] > 0
