"""End to end through the real CLI with dataset and results on a real S3 server (SeaweedFS):
`vlmbatch submit s3://... --output s3://...` in-process on a tiny checkpoint, then
`vlmbatch results` (--errors-only, --merge to a local file; submit prints the summary)."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_harness import S3Endpoint
from test_submit_e2e import png_bytes, qwen_prompt, vlmbatch

from vlmbatch.errors import JobError
from vlmbatch.io.storage import resolve
from vlmbatch.job.plan import plan_job


def put(s3: S3Endpoint, url: str, data: bytes, tmp_path: Path) -> None:
    """Upload through vlmbatch's storage layer (the test's own setup, not the code under test)."""
    local = tmp_path / f"upload-{uuid.uuid4().hex}"
    local.write_bytes(data)
    target = resolve(url, s3.storage_options())
    target.storage.put(local, target.path)


def test_jsonl_job_on_object_storage_end_to_end(s3_server: S3Endpoint, tiny_qwen: Path, tmp_path: Path) -> None:
    prefix = f"s3://{s3_server.bucket}/e2e-{uuid.uuid4().hex[:8]}"
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes("blue")).decode()
    rows = [
        {"id": "img", "prompt": qwen_prompt("Describe it."), "image": data_url, "lang": "en"},
        {"id": "chat", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What?"}]}]},
        {"id": "text", "prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "lang": "de"},
        {"id": "empty", "prompt": "  "},
        {"id": "broken-image", "prompt": qwen_prompt("x"), "image": "data:image/png;base64,aGVsbG8="},
    ]  # fmt: skip
    lines = [json.dumps(row).encode() + b"\n" for row in rows] + [b"{not json\n"]
    offsets = [sum(len(line) for line in lines[:i]) for i in range(len(lines))]
    put(s3_server, f"{prefix}/rows.jsonl", b"".join(lines), tmp_path)
    options = json.dumps(s3_server.storage_options())

    proc = vlmbatch("submit", f"{prefix}/rows.jsonl", "--model", str(tiny_qwen), "--output", f"{prefix}/out",
                    "--storage-options", options, "--engine", "paged", "--max-tokens", "3", "--shard-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = proc.stdout.strip().splitlines()[0]
    assert "6 (3 ok, 3 failed)" in proc.stderr
    job_url = f"{prefix}/out/{job_id}"

    errors = vlmbatch("results", job_id, "--output", f"{prefix}/out", "--errors-only", "--storage-options", options)
    assert errors.returncode == 0 and "prompt_empty" in errors.stdout and "invalid_row" in errors.stdout, errors.stderr

    merged = tmp_path / "merged.parquet"
    merge = vlmbatch("results", job_url, "--merge", str(merged), "--storage-options", options)
    assert merge.returncode == 0, merge.stderr
    table = pq.read_table(merged)
    # JSONL on object storage: row ids are the offsets of the rows' lines, each row once, in order.
    assert table.column("row_id").to_pylist() == offsets
    assert table.column("id").to_pylist() == ["img", "chat", "text", "empty", "broken-image", str(offsets[5])]
    assert table.column("error_type").to_pylist() == [None, None, None, "prompt_empty", "media_decode_error", "invalid_row"]
    assert table.column("lang").to_pylist() == ["en", None, "de", None, None, None]
    assert all(n > 0 for n in table.column("num_generated_tokens").to_pylist()[:3])


def test_parquet_job_configured_by_the_aws_environment(s3_server: S3Endpoint, tiny_qwen: Path, tmp_path: Path) -> None:
    """No --storage-options: the endpoint and credentials come from the standard AWS variables."""
    prefix = f"s3://{s3_server.bucket}/e2e-{uuid.uuid4().hex[:8]}"
    good = png_bytes("yellow")
    table = pa.table({
        "id": ["a", "b", "c"],
        "prompt": [qwen_prompt("What colour?")] * 3,
        "image": [{"bytes": good, "path": None}, {"bytes": b"garbage", "path": None}, {"bytes": good, "path": None}],
    })  # fmt: skip
    local = tmp_path / "rows.parquet"
    pq.write_table(table, local, row_group_size=1)
    put(s3_server, f"{prefix}/rows.parquet", local.read_bytes(), tmp_path)
    env = {**s3_server.env(), "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}

    proc = vlmbatch("submit", f"{prefix}/rows.parquet", "--model", str(tiny_qwen), "--output", f"{prefix}/out",
                    "--engine", "hf", "--max-tokens", "2", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = f"{prefix}/out/{proc.stdout.strip().splitlines()[0]}/results".removeprefix("s3://")
    result = pq.read_table(results, filesystem=s3_server.arrow_fs()).sort_by("row_id")  # where it lies
    assert result.column("row_id").to_pylist() == [0, 1, 2]
    assert result.column("error_type").to_pylist() == [None, "media_decode_error", None]


def test_a_missing_object_is_refused_before_anything_is_written(s3_server: S3Endpoint, tiny_qwen: Path) -> None:
    prefix = f"s3://{s3_server.bucket}/e2e-{uuid.uuid4().hex[:8]}"
    proc = vlmbatch("submit", f"{prefix}/absent.jsonl", "--model", str(tiny_qwen), "--output", f"{prefix}/out",
                    "--storage-options", json.dumps(s3_server.storage_options()))
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and f"dataset not found: {prefix}/absent.jsonl" in message[0], proc.stderr
    assert not resolve(f"{prefix}/out", s3_server.storage_options()).exists()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("bad-option", "unknown option(s) ['endpoint']"),
        ("read-only", "cannot write the job's manifest to s3://"),
    ],
)
def test_bad_object_storage_jobs_are_refused_by_plan_job(
    case: str, expected: str, s3_server: S3Endpoint, tiny_qwen: Path, tmp_path: Path
) -> None:
    prefix = f"s3://{s3_server.bucket}/e2e-{uuid.uuid4().hex[:8]}"
    put(s3_server, f"{prefix}/rows.jsonl", json.dumps({"prompt": "hi"}).encode() + b"\n", tmp_path)
    options = s3_server.storage_options()
    if case == "bad-option":
        options = {**options, "endpoint": options["endpoint_url"]}
    elif case == "read-only":  # may read the dataset, may not write the output
        options = s3_server.read_only().storage_options()
    with pytest.raises(JobError) as refused:
        plan_job(f"{prefix}/rows.jsonl", str(tiny_qwen), f"{prefix}/out", storage_options=options)
    assert expected in str(refused.value)
    assert not resolve(f"{prefix}/out", s3_server.storage_options()).exists()


def test_s3_media_urls_in_rows_load_through_the_media_rules(s3_server: S3Endpoint, tiny_qwen: Path, tmp_path: Path) -> None:
    """Rows naming their images by s3:// URL (in-process job, local dataset): read with the
    job's storage options; a missing object is that row's media_not_found."""
    prefix = f"s3://{s3_server.bucket}/media-{uuid.uuid4().hex[:8]}"
    put(s3_server, f"{prefix}/cat.png", png_bytes("green"), tmp_path)
    dataset = tmp_path / "rows.jsonl"
    rows = [{"id": "there", "prompt": qwen_prompt("Colour?"), "image": f"{prefix}/cat.png"},
            {"id": "absent", "prompt": qwen_prompt("Colour?"), "image": f"{prefix}/dog.png"}]  # fmt: skip
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(tmp_path / "out"),
                    "--storage-options", json.dumps(s3_server.storage_options()), "--engine", "hf", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_dir = tmp_path / "out" / proc.stdout.strip().splitlines()[0]
    result = pq.read_table(job_dir / "results").sort_by("row_id").to_pylist()
    assert [r["error_type"] for r in result] == [None, "media_not_found"], result
    assert result[0]["num_input_tokens"] > 10  # the image's tokens are in the prompt
