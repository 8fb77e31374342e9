"""What a job's output folder says about its shards: the manifest plus the committed parts
are the source of truth, for the in-process runner, the queue's client and its workers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmbatch.io.storage import Location


def pending_shards(manifest: Any, job_dir: Location) -> list[int]:
    """Shards without a committed part (one listing of `results/`, also on object storage)."""
    from vlmbatch.io.manifest import results_dir  # here: io.readers imports the job package
    from vlmbatch.io.storage import list_names

    present = list_names(results_dir(job_dir))
    return [s.shard_id for s in manifest.shards if manifest.part_path(s.shard_id).name not in present]


def committed_shards(manifest: Any) -> set[int]:
    """Shards whose part is in `results/`."""
    return {s.shard_id for s in manifest.shards} - set(pending_shards(manifest, manifest.job_dir))


def part_counts(path: Location) -> tuple[int, int]:
    """(ok, failed) rows of a committed part, from its `error_type` column alone."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from vlmbatch.io.storage import parquet_source

    errors = pq.read_table(parquet_source(path), columns=["error_type"]).column("error_type")
    failed = len(errors) - pc.count(errors, mode="only_null").as_py()
    return len(errors) - failed, failed
