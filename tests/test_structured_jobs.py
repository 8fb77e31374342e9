"""Structured outputs through the job path (plan → shard runner → paged engine → Parquet) on the
tiny random-weight Qwen2.5-VL checkpoint: typed `output` columns DuckDB reads, per-row specs
in `output_json`, and the per-row errors."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import jsonschema
import pyarrow.parquet as pq
import pytest
from structured_harness import NESTED_SCHEMA, single_torch_thread  # noqa: F401  (autouse fixture)

from vlmbatch import job as jobs
from vlmbatch.config import EngineConfig, MediaConfig, WorkerConfig
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType
from vlmbatch.job.plan import structured_output_option
from vlmbatch.job.preparer import RowPreparer
from vlmbatch.structured.spec import parse_structured_output


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return jobs.load_llm(str(tiny_qwen), EngineConfig(engine="paged", dtype="float32", device="cpu", max_num_seqs=64))


def _run(llm, dataset: Path, output: Path, **plan) -> tuple[Path, list[dict]]:
    manifest, job_dir = jobs.plan_job(dataset, llm.model_name, output, shard_size=100, **plan)
    with RowPreparer(WorkerConfig(preprocess_workers=0), MediaConfig()) as preparer:
        jobs.run_job_locally(manifest, job_dir, llm, preparer, show_progress=False)
    return job_dir, pq.read_table(job_dir / "results").sort_by("row_id").to_pylist()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_200_rows_under_a_nested_schema_give_a_typed_output_column(llm, tmp_path):
    """Seeded sampling makes every row's JSON different; each validates, and the struct,
    list and enum fields are columns DuckDB reads."""
    rows = [{"id": f"r{i}", "prompt": f"Invoice {i}: give vendor, total, items.", "seed": i, "temperature": 1.0} for i in range(200)]
    dataset = _write_jsonl(tmp_path / "rows.jsonl", rows)
    spec = structured_output_option({"type": "json_schema", "json_schema": {"name": "invoice", "schema": NESTED_SCHEMA}}, None)
    job_dir, results = _run(llm, dataset, tmp_path / "out", sampling=SamplingParams(max_tokens=400), structured_output=spec)
    assert len(results) == 200
    texts = set()
    for row in results:
        assert row["error_type"] is None and row["finish_reason"] == "stop", row
        value = json.loads(row["generated_text"])
        jsonschema.validate(value, NESTED_SCHEMA)
        texts.add(row["generated_text"])
        assert row["output"]["vendor"] == value["vendor"] and row["output"]["currency"] == value["currency"]
        assert row["output"]["address"] == (None if "address" not in value else {"city": value["address"]["city"], "zip": value["address"].get("zip")})
    assert len(texts) > 150  # the rows' own seeds, not one text for all
    parts = f"'{job_dir}/results/*.parquet'"
    by_currency = dict(duckdb.sql(f"select output.currency, count(*) from {parts} group by 1").fetchall())
    assert set(by_currency) <= {"USD", "EUR", "GBP"} and sum(by_currency.values()) == 200
    first = duckdb.sql(f"select output.vendor, output.total, len(output.items), output.items[1].qty from {parts} where id = 'r0'").fetchall()[0]
    value = json.loads(results[0]["generated_text"])
    assert first[:3] == (value["vendor"], pytest.approx(value["total"]), len(value["items"]))
    assert first[3] == (value["items"][0]["qty"] if value["items"] else None)


def test_per_row_specs_errors_and_opt_outs(llm, tmp_path):
    """Rows set their own spec (`output_json`) over the job's, opt out with {"type": "text"};
    an uncompilable row spec, a malformed one and a length cut fail their row alone."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rows = [
        {"id": "job", "prompt": "a"},  # the job's spec (a choice: not JSON, so no output_json)
        {"id": "schema", "prompt": "b", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small}}},
        {"id": "choice", "prompt": "c", "guided_choice": ["red", "green"]},
        {"id": "text", "prompt": "d", "response_format": {"type": "text"}, "max_tokens": 5},
        {"id": "uncompilable", "prompt": "e", "guided_regex": "(unclosed"},
        {"id": "malformed", "prompt": "f", "response_format": {"type": "json_schema"}},
        {"id": "cut", "prompt": "g", "guided_json": NESTED_SCHEMA, "max_tokens": 10},
    ]
    dataset = _write_jsonl(tmp_path / "rows.jsonl", rows)
    job_spec = parse_structured_output({"guided_choice": ["yes", "no"]})
    _, results = _run(llm, dataset, tmp_path / "out", sampling=SamplingParams(max_tokens=30, temperature=0), structured_output=job_spec)
    by_id = {row["id"]: row for row in results}
    assert by_id["job"]["generated_text"] in ("yes", "no") and by_id["job"]["output_json"] is None
    assert json.loads(by_id["schema"]["output_json"])["ok"] in (True, False) and by_id["schema"]["error_type"] is None
    assert by_id["choice"]["generated_text"] in ("red", "green") and by_id["choice"]["output_json"] is None
    assert by_id["text"]["error_type"] is None and by_id["text"]["num_generated_tokens"] == 5 and by_id["text"]["output_json"] is None
    assert by_id["uncompilable"]["error_type"] == ErrorType.INVALID_ROW and "guided_regex" in by_id["uncompilable"]["error"]
    assert by_id["malformed"]["error_type"] == ErrorType.INVALID_ROW and "schema" in by_id["malformed"]["error"]
    cut = by_id["cut"]
    assert cut["error_type"] == ErrorType.STRUCTURED_OUTPUT_INCOMPLETE and cut["finish_reason"] == "length"
    assert cut["generated_text"].startswith('{"vendor"') and cut["output_json"] is None


def test_openai_batch_bodies_carry_their_response_format(llm, tmp_path):
    """`body.response_format` of an OpenAI Batch line is the row's spec (`output_json`)."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["ok", "n"], "additionalProperties": False}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"row {i}"}], "max_tokens": 40,
                       "temperature": 1.0, "seed": i,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small, "strict": True}}}}
             for i in range(3)]
    _, results = _run(llm, _write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out")
    assert [row["custom_id"] for row in results] == ["c0", "c1", "c2"]
    for row in results:
        assert row["error_type"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["output_json"]), small)
