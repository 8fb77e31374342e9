"""`vlmbatch bench structured` end to end on a small vocabulary (the figures come from the
GPU host; this keeps the benchmark from rotting)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_structured_runs_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vlmbatch.cli", "bench", "structured", "--vocab-size", "3000", "--batches", "4",
         "--steps", "2", "--threads", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["vocab_size"] == 3000 and set(report["xgrammar"]["compile_ms"]) == {"invoice", "plain"}
    fills = report["xgrammar"]["fill_ms"]
    assert {"invoice/serial@4", "invoice/batch/2@4", "plain/pythreads/2@4"} <= set(fills)
    assert all(value["wall_ms"] > 0 for value in fills.values())
    assert set(report["xgrammar"]["gil_probe"]) == {"sleeping", "python", "filling"}
    assert "plain/par/2@4" in report["llguidance"]["fill_ms"]
