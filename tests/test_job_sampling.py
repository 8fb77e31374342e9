"""n, logprobs and penalties through the real CLI: a job file plus flags, rows with their own
`logprobs` / `top_logprobs` / penalties, results read back with pyarrow and DuckDB."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from test_submit_e2e import job_dir_from, vlmbatch
from transformers import AutoTokenizer

from vlmbatch.io.results import merge, summarize
from vlmbatch.io.schema import LOGPROBS_FIELD

PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_samples_and_logprobs_columns(tiny_qwen: Path, tmp_path: Path) -> None:
    rows = [
        {"id": "a", "prompt": PROMPT.format("the cat sits on the mat")},
        {"id": "b", "prompt": PROMPT.format("a dog runs"), "logprobs": True, "top_logprobs": 3, "presence_penalty": 1.0},
        {"id": "bad", "prompt": PROMPT.format("x"), "repetition_penalty": 0},
        {"id": "c", "prompt": PROMPT.format("hello there"), "logit_bias": {"33": 5}, "min_tokens": 3},
        {"id": "far", "prompt": PROMPT.format("x"), "logit_bias": {"99999999": 5}},  # not a token of the model
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "job.yaml").write_text(
        f"dataset: rows.jsonl\nmodel: {tiny_qwen}\noutput: out\nshard_size: 2\nengine: {{name: paged}}\n"
        "sampling: {max_tokens: 5, temperature: 0.8, seed: 3, n: 3, logprobs: 2}\n"
    )
    proc = vlmbatch("submit", str(tmp_path / "job.yaml"), "--n", "2")  # the flag wins over the file's n
    job_dir = job_dir_from(proc, tmp_path / "out")
    results = job_dir / "results"
    schemas = [pq.read_schema(p) for p in sorted(results.glob("*.parquet"))]
    assert len(schemas) == 3 and schemas[0] == schemas[1] == schemas[2]  # one schema in every part
    assert schemas[0].field("sample_index").type == pa.int32()
    assert schemas[0].field("logprobs").type == LOGPROBS_FIELD.type

    table = pq.read_table(results).sort_by([("row_id", "ascending"), ("sample_index", "ascending")])
    by_id: dict[str, list[dict]] = {}
    for row in table.to_pylist():
        by_id.setdefault(row["id"], []).append(row)
    assert [r["sample_index"] for r in by_id["bad"]] == [0] and by_id["bad"][0]["error_type"] == "invalid_row"
    assert by_id["bad"][0]["logprobs"] is None
    assert [r["sample_index"] for r in by_id["far"]] == [0] and by_id["far"][0]["error_type"] == "invalid_row"
    assert "vocabulary" in by_id["far"][0]["error"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen)
    for name, top_k in (("a", 2), ("b", 3), ("c", 2)):
        samples = by_id[name]
        assert [r["sample_index"] for r in samples] == [0, 1] and {r["row_id"] for r in samples} == {samples[0]["row_id"]}
        for row in samples:
            entries = row["logprobs"]
            assert len(entries) == row["num_generated_tokens"] > 0
            ids = [e["token_id"] for e in entries]
            assert tokenizer.decode(ids, skip_special_tokens=True) == row["generated_text"]
            assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == top_k for e in entries)
            assert all(e["token"] == tokenizer.decode([e["token_id"]]) for e in entries)
            tops = [[t["logprob"] for t in e["top_logprobs"]] for e in entries]
            assert all(t == sorted(t, reverse=True) for t in tops)
        assert samples[0]["generated_text"] != samples[1]["generated_text"] or samples[0]["logprobs"] != samples[1]["logprobs"]
    assert len(by_id["c"][0]["logprobs"]) >= 3  # min_tokens

    unnested = duckdb.connect().execute(
        f"select id, sample_index, t.token_id, t.logprob, len(t.top_logprobs) from "
        f"(select id, sample_index, unnest(logprobs) as t from read_parquet('{results}/*.parquet')) order by all"
    ).fetchall()
    assert len(unnested) == sum(r["num_generated_tokens"] for r in table.to_pylist())
    assert {k for *_, k in unnested} == {2, 3}

    summary = summarize(job_dir)  # a row's samples are one row, not duplicates
    assert summary.complete and (summary.rows, summary.rows_ok, summary.rows_failed) == (5, 3, 2)
    assert summary.output_tokens == sum(r["num_generated_tokens"] for r in table.to_pylist())
    merged = tmp_path / "merged.parquet"
    assert merge(job_dir, merged) == table.num_rows == 8
    assert pq.read_table(merged).column("row_id").to_pylist() == sorted(table.column("row_id").to_pylist())
