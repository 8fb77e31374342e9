"""What a job's output folder says about its shards: the manifest plus the committed parts
are the source of truth, for the in-process runner, the queue's client and its workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pending_shards(manifest: Any, job_dir: Path) -> list[int]:
    """Shards without a committed part."""
    return [s.shard_id for s in manifest.shards if not manifest.part_path(s.shard_id).exists()]


def committed_shards(manifest: Any) -> set[int]:
    """Shards whose part is in `results/`."""
    return {s.shard_id for s in manifest.shards} - set(pending_shards(manifest, manifest.job_dir))


def part_counts(path: Path) -> tuple[int, int]:
    """(ok, failed) rows of a committed part, from its `error_type` column alone."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    errors = pq.read_table(path, columns=["error_type"]).column("error_type")
    failed = len(errors) - pc.count(errors, mode="only_null").as_py()
    return len(errors) - failed, failed
