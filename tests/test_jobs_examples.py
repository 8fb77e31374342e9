"""The runnable examples in jobs/: their job files parse and pass every submit-time check, and
each runs on the tiny model: the structured ones constrained (random weights, valid output)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest

from test_submit_e2e import job_dir_from, vlmbatch
from vlmbatch.job.jobfile import load_job_file
from vlmbatch.testing.invoices import INVOICE_SCHEMA, make_invoice, write_invoice_dataset

JOBS = Path(__file__).resolve().parents[1] / "jobs"
EXAMPLES = {"captioning": "job.yaml", "invoice-extraction": "job.yaml", "video-qa": "job.toml"}


def _run(name: str, model: Path, output: Path, *flags: str) -> tuple[Path, list[dict]]:
    proc = vlmbatch("submit", str(JOBS / name / EXAMPLES[name]), "--model", str(model), "--output", str(output), *flags, timeout=600)
    job_dir = job_dir_from(proc, output)
    return job_dir, pq.read_table(job_dir / "results").sort_by("row_id").to_pylist()


# slow: each example's run below passes the same checks (submit refuses a job that fails them,
# and every row must succeed), as captioning's always did; this is the dry run's view of them.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["invoice-extraction", "video-qa"])
def test_structured_example_passes_the_submit_checks(name: str, tiny_qwen: Path, tmp_path: Path) -> None:
    options = load_job_file(JOBS / name / EXAMPLES[name])
    assert Path(options["dataset"]).exists()  # a local path, resolved against the job file
    proc = vlmbatch("submit", str(JOBS / name / EXAMPLES[name]), "--model", str(tiny_qwen), "--output", str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(0 would fail)" in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_invoice_example_data_is_the_generators(tmp_path: Path) -> None:
    """The job file tells users `write_invoice_dataset(DIR, N)` makes more of these rows."""
    folder = JOBS / "invoice-extraction"
    assert json.loads((folder / "schema.json").read_text()) == INVOICE_SCHEMA
    rows = [json.loads(line) for line in (folder / "invoices.jsonl").read_text().splitlines()]
    from PIL import Image

    for row in rows:
        seed = int(row["id"].split("-")[1])
        assert np.array_equal(np.asarray(Image.open(folder / row["image"])), np.asarray(make_invoice(seed)))
    written = write_invoice_dataset(tmp_path, len(rows) + 2)
    assert [json.loads(line) for line in written.read_text().splitlines()][: len(rows)] == rows
    assert (tmp_path / f"images/invoice-{len(rows) + 1}.png").exists()


def test_captioning_example_runs_on_the_tiny_model(tiny_qwen: Path, tmp_path: Path) -> None:
    assert load_job_file(JOBS / "captioning" / "job.yaml")["max_tokens"] == 48
    _, rows = _run("captioning", tiny_qwen, tmp_path / "out", "--max-tokens", "4")
    assert len(rows) == 6 and all(r["error_type"] is None and r["generated_text"] is not None for r in rows)


def test_invoice_example_extracts_typed_fields_on_the_tiny_model(tiny_qwen: Path, tmp_path: Path) -> None:
    job_dir, rows = _run("invoice-extraction", tiny_qwen, tmp_path / "out")
    assert len(rows) == 4
    for row in rows:
        assert row["error_type"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["generated_text"]), INVOICE_SCHEMA)
        assert row["output"] == {k: v for k, v in json.loads(row["generated_text"]).items()}
    totals = duckdb.sql(f"select output.total, output.currency from '{job_dir}/results/*.parquet'").fetchall()
    assert len(totals) == 4 and all(currency in INVOICE_SCHEMA["properties"]["currency"]["enum"] for _, currency in totals)


def test_video_qa_example_answers_from_the_choices_on_the_tiny_model(tiny_qwen: Path, tmp_path: Path) -> None:
    _, rows = _run("video-qa", tiny_qwen, tmp_path / "out")
    assert len(rows) == 4 and all(r["output"] in ("yes", "no") and r["generated_text"] == r["output"] for r in rows)
