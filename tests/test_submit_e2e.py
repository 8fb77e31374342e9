"""End to end through the real CLI: `vlmbatch submit` in-process on a tiny checkpoint.

Every input row must come back exactly once (by row_id), bad rows as error rows, and
the results must be readable by pyarrow, DuckDB and Polars as they lie on disk.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def vlmbatch(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would (a fresh process each time)."""
    return subprocess.run(
        [sys.executable, "-m", "vlmbatch.cli", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def png_bytes(color: str = "red", size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def qwen_prompt(text: str, images: int = 1) -> str:
    return f"<|im_start|>user\n{QWEN_IMAGE * images}{text}<|im_end|>\n<|im_start|>assistant\n"


def write_media(folder: Path) -> dict[str, str]:
    """Good and bad media files next to the dataset; returns name → relative path."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    good = png_bytes("blue")
    (folder / "img/good.png").write_bytes(good)
    (folder / "img/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    (folder / "img/truncated.png").write_bytes(png_bytes("green", (256, 256))[:300])
    bomb = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(bomb, format="PNG")  # 144 MP, a few KB on disk
    (folder / "img/bomb.png").write_bytes(bomb.getvalue())
    return {"good": "img/good.png"}


# (row, expected error_type or None). Order matters: row_id is the line number.
def dataset_rows(good_data_url: str) -> list[tuple[dict, str | None]]:
    return [
        ({"id": "ok-path", "prompt": qwen_prompt("Describe the image."), "image": "img/good.png", "lang": "en"}, None),
        ({"id": "ok-chat", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": good_data_url}},
            {"type": "text", "text": "What is this?"}]}], "lang": "en"}, None),
        ({"id": "ok-text", "prompt": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 3}, None),
        ({"id": "ok-two", "prompt": qwen_prompt("Compare them.", 2), "images": ["img/good.png", "img/good.png"]}, None),
        ({"id": "corrupt", "prompt": qwen_prompt("x"), "image": "img/corrupt.png"}, "media_decode_error"),
        ({"id": "truncated", "prompt": qwen_prompt("x"), "image": "img/truncated.png"}, "media_decode_error"),
        ({"id": "missing", "prompt": qwen_prompt("x"), "image": "img/nope.png"}, "media_not_found"),
        ({"id": "unreachable", "prompt": qwen_prompt("x"), "image": "http://127.0.0.1:9/x.png"}, "media_fetch_error"),
        ({"id": "not-image", "prompt": qwen_prompt("x"), "image": "data:text/plain;base64,aGVsbG8="}, "media_decode_error"),
        ({"id": "bomb", "prompt": qwen_prompt("x"), "image": "img/bomb.png"}, "media_too_large"),
        ({"id": "empty", "prompt": "   "}, "prompt_empty"),
        ({"id": "too-long", "prompt": qwen_prompt("word " * 5000, images=0)}, "prompt_too_long"),
        ({"id": "mismatch", "prompt": qwen_prompt("two placeholders, one image", 2), "image": "img/good.png"}, "placeholder_mismatch"),
        ({"id": "bad-override", "prompt": qwen_prompt("x"), "image": "img/good.png", "temperature": -1}, "invalid_row"),
    ]


def check_results(job_dir: Path, expected: list[str | None], id_column: str = "id") -> pa.Table:
    """Every row exactly once, with the expected error types; readable by three engines."""
    results = job_dir / "results"
    table = pq.read_table(results)  # pyarrow dataset read of the folder
    assert sorted(table.column("row_id").to_pylist()) == list(range(len(expected)))
    by_row = {r["row_id"]: r for r in table.to_pylist()}
    for row_id, error_type in enumerate(expected):
        row = by_row[row_id]
        assert row["error_type"] == error_type, (row_id, row)
        if error_type is None:
            assert row["finish_reason"] in ("stop", "length")
            assert row["num_input_tokens"] > 0 and row["num_generated_tokens"] > 0
            assert isinstance(row["generated_text"], str)
        else:
            assert row["finish_reason"] == "error" and row["error"]
    duck = duckdb.connect().execute(f"select count(*), count(distinct row_id) from read_parquet('{results}/*.parquet')").fetchone()
    assert duck == (len(expected), len(expected))
    assert pl.read_parquet(f"{results}/*.parquet").height == len(expected)
    assert table.schema.field(id_column).type == pa.string()
    return table


def job_dir_from(proc: subprocess.CompletedProcess, output: Path) -> Path:
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = proc.stdout.strip().splitlines()[0]
    return output / job_id


def test_jsonl_job_accounts_for_every_row_including_bad_ones(tiny_qwen: Path, tmp_path: Path) -> None:
    write_media(tmp_path)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes("red")).decode()
    rows = dataset_rows(data_url)
    dataset = tmp_path / "rows.jsonl"
    lines = [json.dumps(r).encode() for r, _ in rows] + [b'{"id": "latin1", "prompt": "caf\xe9"}']
    dataset.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output),
                    "--engine", "paged", "--max-tokens", "4", "--shard-size", "5")
    job_dir = job_dir_from(proc, output)
    table = check_results(job_dir, [e for _, e in rows] + ["invalid_row"])
    assert len(list((job_dir / "results").glob("*.parquet"))) == 3
    assert set(table.column("lang").to_pylist()) == {"en", None}
    assert "15 (4 ok, 11 failed)" in proc.stderr

    merged = tmp_path / "merged.parquet"
    merge = vlmbatch("results", str(job_dir), "--merge", str(merged))
    assert merge.returncode == 0, merge.stderr
    assert pq.read_table(merged).column("row_id").to_pylist() == list(range(15))
    errors = tmp_path / "errors.parquet"
    assert vlmbatch("results", str(job_dir), "--merge", str(errors), "--errors-only").returncode == 0
    assert pq.read_table(errors).num_rows == 11


def test_parquet_job_with_hf_image_structs_and_column_mapping(tiny_qwen: Path, tmp_path: Path) -> None:
    good = png_bytes("yellow")
    table = pa.table({
        "key": ["a", "b", "c", "d"],
        "question": [qwen_prompt("What colour?")] * 3 + [qwen_prompt("Broken?")],
        "picture": [{"bytes": good, "path": "a.png"}, {"bytes": good, "path": None},
                    {"bytes": None, "path": "missing.png"}, {"bytes": b"garbage", "path": None}],
        "score": [1.5, 2.5, None, 4.0],
    })
    dataset = tmp_path / "rows.parquet"
    pq.write_table(table, dataset, row_group_size=2)
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output), "--engine", "hf",
                    "--max-tokens", "3", "--id-column", "key", "--prompt-column", "question", "--image-column", "picture")
    job_dir = job_dir_from(proc, output)
    result = check_results(job_dir, [None, None, "media_not_found", "media_decode_error"])
    assert result.sort_by("row_id").column("id").to_pylist() == ["a", "b", "c", "d"]
    assert result.sort_by("row_id").column("score").to_pylist() == [1.5, 2.5, None, 4.0]


def test_parquet_columns_as_exporters_write_them(tiny_qwen: Path, tmp_path: Path) -> None:
    """Binary prompts, chat messages / image lists / logit biases as JSON text, a stop string:
    each read as the value it encodes, and each malformed one is its row's `invalid_row`."""
    write_media(tmp_path)
    chat = json.dumps([{"role": "user", "content": "Hello"}])
    rows = [  # (prompt bytes, messages JSON, images, stop, logit_bias JSON) -> error_type
        ((qwen_prompt("Describe.", 0).encode(), None, None, "###", None), None),
        ((b"\xff\xfe not utf-8", None, None, None, None), "invalid_row"),
        ((None, chat, None, None, '{"11": -100}'), None),
        ((None, '[{"role": ', None, None, None), "invalid_row"),
        ((None, "[]", None, None, None), "invalid_row"),
        ((qwen_prompt("Two?", 2).encode(), None, '["img/good.png", "img/good.png"]', None, None), None),
        ((qwen_prompt("One?").encode(), None, "img/good.png", None, None), None),
        ((qwen_prompt("List?").encode(), None, '["img/good.png"', None, None), "invalid_row"),
        ((None, chat, None, None, "{bad"), "invalid_row"),
    ]
    columns = list(zip(*(values for values, _ in rows)))
    table = pa.table({
        "prompt": pa.array(columns[0], pa.binary()), "messages": pa.array(columns[1], pa.string()),
        "images": pa.array(columns[2], pa.string()), "stop": pa.array(columns[3], pa.string()),
        "logit_bias": pa.array(columns[4], pa.string()),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "rows.parquet")
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(tmp_path / "rows.parquet"), "--model", str(tiny_qwen), "--output", str(output),
                    "--engine", "paged", "--max-tokens", "3")  # fmt: skip
    result = {r["row_id"]: r for r in check_results(job_dir_from(proc, output), [e for _, e in rows]).to_pylist()}
    assert "not valid UTF-8" in result[1]["error"] and "'prompt'" in result[1]["error"]
    assert "not valid JSON" in result[3]["error"] and "non-empty list" in result[4]["error"]
    assert "'images'" in result[7]["error"] and "'logit_bias'" in result[8]["error"]
    assert result[5]["num_input_tokens"] > result[6]["num_input_tokens"] > result[0]["num_input_tokens"]  # two images, one, none


def test_openai_batch_input_keeps_custom_id(tiny_qwen: Path, tmp_path: Path) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes("red")).decode()
    lines = []
    for i in range(3):
        body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": f"Question {i}"}, {"type": "image_url", "image_url": {"url": data_url}}]}]}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    dataset = tmp_path / "batch.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    job_dir = job_dir_from(vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output), "--engine", "hf"), output)
    table = check_results(job_dir, [None, None, None], id_column="custom_id")
    assert table.sort_by("row_id").column("custom_id").to_pylist() == ["req-0", "req-1", "req-2"]
    assert set(table.column("num_generated_tokens").to_pylist()) <= {1, 2}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing-file", "not found"),
        ("unknown-format", "format"),
        ("no-prompt-column", "prompt"),
        ("unknown-model", "model not found"),
    ],
)
def test_bad_jobs_are_refused_before_anything_is_written(case: str, expected: str, tiny_qwen: Path, tmp_path: Path) -> None:
    dataset, model = tmp_path / "rows.jsonl", str(tiny_qwen)
    dataset.write_text(json.dumps({"prompt": "hi"}) + "\n")
    if case == "missing-file":
        dataset = tmp_path / "absent.jsonl"
    elif case == "unknown-format":
        dataset = tmp_path / "rows.xlsx"
        dataset.write_bytes(b"PK\x03\x04 not a dataset")
    elif case == "no-prompt-column":
        dataset.write_text(json.dumps({"text": "hi", "image": "a.png"}) + "\n")
    elif case == "unknown-model":
        model = str(tmp_path / "no-such-model")
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(dataset), "--model", model, "--output", str(output))
    assert proc.returncode == 2
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and expected in message[0].lower(), proc.stderr
    assert not output.exists() or not any(output.iterdir())


def test_empty_dataset_completes_with_an_empty_typed_result(tiny_qwen: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "empty.jsonl"
    dataset.write_text("")
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output), "--engine", "hf")
    job_dir = job_dir_from(proc, output)
    assert "empty" in proc.stderr
    table = pq.read_table(job_dir / "results")
    assert table.num_rows == 0
    assert {"row_id", "id", "generated_text", "error_type", "finished_at"} <= set(table.schema.names)
    assert duckdb.connect().execute(f"select count(*) from read_parquet('{job_dir}/results/*.parquet')").fetchone() == (0,)


def test_dry_run_reports_row_errors_and_writes_nothing(tiny_qwen: Path, tmp_path: Path) -> None:
    write_media(tmp_path)
    rows = dataset_rows("data:image/png;base64," + base64.b64encode(png_bytes()).decode())
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r, _ in rows) + "\n")
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(dataset), "--model", str(tiny_qwen), "--output", str(output), "--dry-run")
    assert proc.returncode == 1  # some rows would fail
    report = proc.stdout + proc.stderr
    failing = sum(1 for _, e in rows if e)
    assert f"{len(rows)} ({failing} would fail)" in report
    for error_type in {e for _, e in rows if e}:
        assert error_type in report
    assert not output.exists()


def test_readme_demo_command(tmp_path: Path) -> None:
    """The README's first command, as written, in a temporary output folder."""
    repo = Path(__file__).resolve().parents[1]
    env = {"VLMBATCH_OUTPUT_DIR": str(tmp_path / "out"), "VLMBATCH_DEMO_MODEL": str(tmp_path / "tiny")}
    proc = subprocess.run(["bash", "scripts/demo.sh"], cwd=repo, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = proc.stdout.strip().splitlines()[-1]  # submit prints the job id last on stdout
    table = pq.read_table(tmp_path / "out" / job_id / "results")
    demo_rows = len((repo / "jobs/demo/images.jsonl").read_text().splitlines())
    assert table.num_rows == demo_rows and table.column("error_type").null_count == demo_rows
    assert "rows/s" in proc.stderr


def _one_row_dataset(folder: Path) -> Path:
    dataset = folder / "rows.jsonl"
    dataset.write_text(json.dumps({"id": "a", "prompt": qwen_prompt("Describe.", images=0)}) + "\n")
    return dataset


def test_job_file_options_with_command_line_flags_winning(tiny_qwen: Path, tmp_path: Path) -> None:
    _one_row_dataset(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"dataset: rows.jsonl\nmodel: {tiny_qwen}\noutput: from-file\nshard_size: 7\n"
        "sampling: {max_tokens: 9, temperature: 0, seed: 5}\nengine: {name: hf}\n"
        'response_format: {type: json_schema, json_schema: {name: answer, schema: {type: object, properties: {a: {type: integer}}, required: [a]}}}\n'
    )
    output = tmp_path / "from-flag"
    proc = vlmbatch("submit", str(job), "--max-tokens", "2", "--output", str(output))
    job_dir = job_dir_from(proc, output)  # --output won over the file's output
    manifest = json.loads((job_dir / "manifest.json").read_text())
    assert manifest["sampling"]["max_tokens"] == 2 and manifest["sampling"]["seed"] == 5 and manifest["shard_size"] == 7
    assert manifest["engine"] == "hf" and manifest["dataset"] == str(tmp_path.resolve() / "rows.jsonl")
    spec = manifest["extra"]["structured_output"]
    assert spec["per_row"] is False and spec["spec"]["kind"] == "json_schema" and json.loads(spec["spec"]["text"])["required"] == ["a"]
    schema = pq.read_schema(next((job_dir / "results").glob("*.parquet")))
    assert schema.field("output").type == pa.struct([pa.field("a", pa.int64(), nullable=False)])
    assert not (tmp_path / "from-file").exists()


@pytest.mark.parametrize(
    "job_text, flags, expected",
    [
        ("dataset: rows.jsonl\nsampling: {max_tokns: 2}\n", [], "unknown key 'sampling.max_tokns'"),
        ("dataset: rows.jsonl\n", ["--json-schema", "bad-schema.json"], "cannot compile this json_schema: minproperties"),
        ("dataset: rows.jsonl\nguided_regex: '(unclosed'\n", [], "cannot compile this regex"),
    ],  # the other refusals of structured_output_option: tests/test_jobfile.py
)
def test_bad_job_files_and_specs_are_refused_before_anything_is_written(job_text, flags, expected, tiny_qwen: Path, tmp_path: Path) -> None:
    _one_row_dataset(tmp_path)
    (tmp_path / "bad-schema.json").write_text(json.dumps({"type": "object", "minProperties": 1}))
    job = tmp_path / "job.yaml"
    job.write_text(job_text)
    output = tmp_path / "out"
    proc = vlmbatch("submit", str(job), "--model", str(tiny_qwen), "--output", str(output), *[
        str(tmp_path / f) if f.endswith(".json") else f for f in flags
    ])  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and expected in message[0].lower(), proc.stderr
    assert not output.exists()
