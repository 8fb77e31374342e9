"""`vlmbatch bench dryrun`: validation speed and memory of `submit --dry-run` on Parquet of small images."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Runs in a fresh process per size so each peak RSS is that run's alone.
_CHILD = """
import json, resource, sys
from vlmbatch.job.dryrun import dry_run
report = dry_run(sys.argv[1], sys.argv[2])
print(json.dumps({"rows": report.rows, "failed": report.rows_failed, "seconds": report.elapsed_s,
                  "startup_seconds": report.startup_s, "rows_per_s": report.rows_per_s,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(model: str, sizes: list[int], workdir: Path | None, json_out: Path | None) -> None:
    """The dry run of `model` on generated Parquet files of each size in `sizes`, each in a fresh process."""
    from vlmbatch.families.registry import load_config
    from vlmbatch.testing.data import write_large_parquet

    family = load_config(model).model_type
    prompt = "USER: <image>\\nDescribe the image.\\nASSISTANT:" if family == "llava" else (
        "<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>\\n<|im_start|>assistant\\n"
    )
    folder = workdir or Path(tempfile.mkdtemp(prefix="vlmbatch-bench-dryrun-"))
    results = []
    for size in sizes:
        dataset = write_large_parquet(folder / f"rows-{size}.parquet", size, prompt=prompt)
        child = subprocess.run([sys.executable, "-c", _CHILD, str(dataset), model], capture_output=True, text=True, check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        results.append(result)
    table = Table("rows", "failed", "seconds", "start-up s", "rows/s", "peak RSS (MiB)", title="submit --dry-run")
    for r in results:
        table.add_row(
            f"{r['rows']:,}", str(r["failed"]), f"{r['seconds']:.2f}", f"{r['startup_seconds']:.2f}",
            f"{r['rows_per_s']:,.0f}", f"{r['peak_rss_mib']:,.0f}",
        )
    Console().print(table)
    if json_out:
        json_out.write_text(json.dumps({"benchmark": "dryrun", "model": model, "results": results}, indent=2))
