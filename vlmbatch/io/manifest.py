"""The job manifest: `OUTPUT/JOB/manifest.json`, the source of truth for a job.

Everything a worker needs to run any shard is here (dataset, columns, sampling,
shard plans, the passthrough schema), so shards can run anywhere, in any order, and
be re-run after a crash. The file is replaced atomically. OUTPUT may be a local folder
or an object-storage prefix (`s3://bucket/prefix`): the manifest lies beside the results
either way.

`storage_options` (endpoint, credentials: `--storage-options`) are never written to the
file; whoever loads a manifest passes their own, and they apply to the dataset and the
job folder alike.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from vlmbatch.errors import JobError
from vlmbatch.io.atomic import atomic_file
from vlmbatch.io.readers import FORMAT_OPENAI_BATCH, ColumnMap, DatasetReader, ShardPlan, open_dataset
from vlmbatch.io.storage import Location, ObjectPath, resolve

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
RESULTS_DIR = "results"
STAGING_DIR = "staging"


def new_job_id(now: datetime | None = None) -> str:
    """Short, sortable by creation time, and unique: `job-20261130-105501-ab12cd`."""
    now = now or datetime.now(timezone.utc)
    return f"job-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def part_name(shard_id: int, num_shards: int) -> str:
    return f"part-{shard_id:05d}-of-{num_shards:05d}.parquet"


def results_dir(job_dir: str | Location) -> Location:
    return resolve(job_dir) / RESULTS_DIR


def staging_dir(job_dir: str | Location) -> Location:
    """Local temp files live here, outside `results/`, so result globs never see them
    (object-storage jobs stage in the local temp folder instead: `io.atomic`)."""
    return resolve(job_dir) / STAGING_DIR


def schema_to_json(schema: pa.Schema) -> dict[str, Any]:
    """Exact Arrow IPC bytes for round-tripping, plus readable field names and types."""
    return {
        "fields": [{"name": f.name, "type": str(f.type)} for f in schema],
        "ipc_base64": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
    }


def schema_from_json(data: dict[str, Any]) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["ipc_base64"])))


@dataclass
class Manifest:
    """One job. `job_dir` is not stored: `load` takes it from where the file lies, so a
    job folder can be moved or mounted elsewhere (workers on other hosts)."""

    job_id: str
    job_dir: Location
    dataset: str
    format: str
    model: str
    engine: str
    columns: ColumnMap
    sampling: dict[str, Any]
    media_io_kwargs: dict[str, Any]
    shard_size: int
    num_rows: int | None  # None: JSONL on object storage, counted only as shards are read
    shards: list[ShardPlan]
    passthrough_schema: pa.Schema
    broker: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    version: int = MANIFEST_VERSION
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_dataset(
        cls,
        reader: DatasetReader,
        *,
        output_dir: str | Location,
        model: str,
        engine: str,
        sampling: dict[str, Any],
        shard_size: int,
        media_io_kwargs: dict[str, Any] | None = None,
        broker: str | None = None,
        job_id: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> "Manifest":
        """Plan a job over an opened dataset (one metadata pass; nothing is written)."""
        shards = reader.plan_shards(shard_size)
        job_id = job_id or new_job_id()
        return cls(
            job_id=job_id,
            job_dir=resolve(output_dir, storage_options).resolve() / job_id,
            dataset=str(reader.path.resolve()),
            format=reader.format,
            model=model,
            engine=engine,
            columns=reader.columns,
            sampling=sampling,
            media_io_kwargs=media_io_kwargs or {},
            shard_size=shard_size,
            num_rows=total_rows(shards),
            shards=shards,
            passthrough_schema=reader.passthrough_schema(),
            broker=broker,
            storage_options=dict(storage_options or {}),
        )

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def result_id_column(self) -> str:
        """`custom_id` for OpenAI Batch input (what users join on), `id` otherwise."""
        return "custom_id" if self.format == FORMAT_OPENAI_BATCH else "id"

    def part_path(self, shard_id: int) -> Location:
        return results_dir(self.job_dir) / part_name(shard_id, self.num_shards)

    def open_dataset(self) -> DatasetReader:
        """The job's dataset, opened with the job's storage options and recorded format."""
        return open_dataset(self.dataset, self.columns, format=self.format, storage_options=self.storage_options)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "job_id": self.job_id,
            "created_at": self.created_at,
            "dataset": self.dataset,
            "format": self.format,
            "model": self.model,
            "engine": self.engine,
            "columns": self.columns.to_dict(),
            "sampling": self.sampling,
            "media_io_kwargs": self.media_io_kwargs,
            "shard_size": self.shard_size,
            "num_rows": self.num_rows,
            "shards": [plan.to_dict() for plan in self.shards],
            "passthrough_schema": schema_to_json(self.passthrough_schema),
            "broker": self.broker,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], job_dir: str | Location, storage_options: dict[str, Any] | None = None
    ) -> "Manifest":
        if data.get("version") != MANIFEST_VERSION:
            raise JobError(f"unsupported manifest version {data.get('version')!r} (expected {MANIFEST_VERSION})")
        return cls(
            job_id=data["job_id"],
            job_dir=resolve(job_dir, storage_options).resolve(),
            dataset=data["dataset"],
            format=data["format"],
            model=data["model"],
            engine=data["engine"],
            columns=ColumnMap.from_dict(data["columns"]),
            sampling=data["sampling"],
            media_io_kwargs=data["media_io_kwargs"],
            shard_size=data["shard_size"],
            num_rows=data["num_rows"],
            shards=[ShardPlan.from_dict(plan) for plan in data["shards"]],
            passthrough_schema=schema_from_json(data["passthrough_schema"]),
            broker=data.get("broker"),
            extra=data.get("extra", {}),
            created_at=data["created_at"],
            version=data["version"],
            storage_options=dict(storage_options or {}),
        )

    def save(self) -> Location:
        """Write `job_dir/manifest.json` atomically (local: temp in staging/, fsync,
        `os.replace`; object storage: one put, which shows the old object or the new one)."""
        path = self.job_dir / MANIFEST_NAME
        with atomic_file(path, staging_dir(self.job_dir)) as handle:
            handle.write(json.dumps(self.to_dict(), indent=2).encode("utf-8"))
        return path

    @classmethod
    def load(cls, job_dir: str | Location, storage_options: dict[str, Any] | None = None) -> "Manifest":
        """The manifest of the job folder `job_dir` (a path or a URL). An `ObjectPath`
        brings its own storage options; `storage_options` apply to a URL string."""
        if isinstance(job_dir, ObjectPath):
            storage_options = job_dir.storage.options
        job_dir = resolve(job_dir, storage_options)
        path = job_dir / MANIFEST_NAME
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError as exc:
            raise JobError(f"not a job folder (no {MANIFEST_NAME}): {job_dir}") from exc
        except (OSError, ValueError) as exc:
            raise JobError(f"unreadable manifest {path}: {exc}") from exc
        return cls.from_dict(data, job_dir, storage_options)


def total_rows(shards: list[ShardPlan]) -> int | None:
    """Rows of all shards, or None when a shard's count is not known until it is read."""
    counts = [plan.num_rows for plan in shards]
    return None if None in counts else sum(c for c in counts if c is not None)
