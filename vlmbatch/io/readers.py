"""Dataset readers: JSONL, OpenAI Batch JSONL and Parquet, local or on object storage.

Planning never loads the data: Parquet shards come from the footer's row groups (on
object storage the footer is read by ranged requests). Local JSONL shards come from one
streaming scan that records the byte offset where each shard's first row starts. JSONL
on object storage is planned without reading the object: split points are spaced by the
mean line length of the leading sample, and a small window read at each one finds the
next line start. Its row count is then unknown until the shards are read, so its row ids
are the byte offsets where the rows' lines start (still unique, ordered and stable,
whatever the shard size). Rows are then streamed one shard at a time in bounded batches,
so a worker's memory does not grow with the file, and it reads only its shard's bytes.

JSONL lines are parsed one by one with `json` rather than `pyarrow.json`: a bad line
must become a `RowError` for that row alone, and rows legitimately differ in shape
(chat messages, optional media), which Arrow's block-wide type inference rejects.

A JSONL line counts as a row unless it is blank (only ASCII whitespace); the same rule
is used when counting, planning and reading, so row ids agree everywhere.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from vlmbatch.chat import TOOLS_REFUSED, refuses_tools
from vlmbatch.errors import ErrorType, JobError, RowError
from vlmbatch.io.schema import RESERVED_NAMES, infer_scalar_type, is_passthrough_type
from vlmbatch.io.storage import Location, ObjectPath, open_input, parquet_source, resolve
from vlmbatch.job.rows import SAMPLING_OVERRIDE_KEYS
from vlmbatch.structured.spec import STRUCTURED_KEYS

FORMAT_JSONL = "jsonl"
FORMAT_OPENAI_BATCH = "openai_batch"
FORMAT_PARQUET = "parquet"

JSONL_EXTENSIONS = frozenset({".jsonl", ".json", ".ndjson"})
PARQUET_EXTENSIONS = frozenset({".parquet", ".pq"})
PARQUET_MAGIC = b"PAR1"

# JSONL column names and passthrough types are inferred from this many leading rows.
SAMPLE_ROWS = 1000
SAMPLE_BYTES = 16 * 1024**2
DEFAULT_BATCH_SIZE = 256
# JSONL is read in chunks that start small (a sample or a window costs little) and double
# up to the largest (a shard streams in few requests on object storage).
FIRST_CHUNK_BYTES = 4096
LARGEST_CHUNK_BYTES = 8 * 1024**2

# How a shard's rows are numbered (`ShardPlan.row_ids`).
ROW_IDS_NUMBER = "number"  # the row's position in the dataset: 0, 1, 2, ...
ROW_IDS_BYTE_OFFSET = "byte_offset"  # JSONL on object storage: where the row's line starts

RowBatch = list[tuple[int, "dict[str, Any] | RowError"]]


@dataclass(frozen=True)
class ColumnMap:
    """Which input columns hold the id, the prompt or messages, and the media.

    A name that differs from its default was chosen by the user (`--image-column ...`),
    so it must exist in the input; default names are optional.
    """

    id: str = "id"
    prompt: str = "prompt"
    messages: str = "messages"
    image: str = "image"
    images: str = "images"
    video: str = "video"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> "ColumnMap":
        return cls(**data)

    def explicit(self) -> dict[str, str]:
        """The mappings the user changed from their defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def content_columns(self) -> frozenset[str]:
        """Columns consumed by the model (never passed through to results)."""
        return frozenset({self.prompt, self.messages, self.image, self.images, self.video})


@dataclass
class ShardPlan:
    """One shard: the row ids [row_start, row_end) and where to find them in the file.

    JSONL shards carry the byte range [byte_start, byte_end) holding their lines;
    Parquet shards carry the indices of the row groups their rows fall in. With
    `row_ids == "byte_offset"` a row id is the offset of the row's line, so the id range
    is the byte range and the number of rows is known only once the shard is read.
    """

    shard_id: int
    row_start: int
    row_end: int
    byte_start: int | None = None
    byte_end: int | None = None
    row_groups: list[int] | None = None
    row_ids: str = ROW_IDS_NUMBER

    @property
    def num_rows(self) -> int | None:
        """Rows in the shard; None while unknown (byte-offset ids)."""
        return self.row_end - self.row_start if self.row_ids == ROW_IDS_NUMBER else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ShardPlan":
        return cls(**data)


class DatasetReader(ABC):
    """One input file. Construction validates the job-level contract (raises `JobError`)."""

    format: str

    def __init__(self, path: Location, columns: ColumnMap):
        self.path = path
        self.columns = columns

    @property
    @abstractmethod
    def column_names(self) -> list[str]:
        """The input's top-level columns (for JSONL: those seen in the leading sample)."""

    @abstractmethod
    def num_rows(self) -> int: ...

    @abstractmethod
    def plan_shards(self, shard_size: int) -> list[ShardPlan]: ...

    @abstractmethod
    def iter_shard(self, plan: ShardPlan, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        """Yield (row_id, raw row or RowError) for the shard's rows, at most batch_size at a time."""

    @abstractmethod
    def iter_rows(self, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        """Like `iter_shard` over the whole file (dry runs, validation)."""

    @abstractmethod
    def passthrough_schema(self) -> pa.Schema:
        """The flat scalar input columns copied into every result part (one schema for all parts).

        Excluded: the id, prompt/messages and media columns, nested values, binary
        blobs, and names that collide with result columns. For JSONL the columns and
        their types come from the leading sample (SAMPLE_ROWS rows or SAMPLE_BYTES); a
        column first seen later is not passed through, and a later value that does not
        fit its column's type becomes null (string columns take any value as its JSON
        text), as `schema.coerce_scalar` defines.
        """

    def _is_passthrough_candidate(self, name: str) -> bool:
        return name not in self.columns.content_columns() and name != self.columns.id and name not in RESERVED_NAMES

    def _validate_columns(self) -> None:
        found = self.column_names
        shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "") if found else "(none)"
        missing = [f"{key}={name!r}" for key, name in self.columns.explicit().items() if name not in found]
        if missing:
            raise JobError(f"{self.path}: mapped column(s) {', '.join(missing)} not found; found: {shown}")
        if self.columns.prompt not in found and self.columns.messages not in found:
            raise JobError(
                f"{self.path}: needs a {self.columns.prompt!r} or a {self.columns.messages!r} column; found: {shown}"
            )


def _check_shard_size(shard_size: int) -> None:
    if not isinstance(shard_size, int) or shard_size < 1:
        raise JobError(f"shard size must be a positive integer, got {shard_size!r}")


def _parse_json_object(line: bytes) -> dict[str, Any] | RowError:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RowError(ErrorType.INVALID_ROW, f"line is not valid UTF-8 (byte {exc.start}: {exc.reason})")
    try:
        value = json.loads(text.lstrip("\ufeff"))
    except json.JSONDecodeError as exc:
        return RowError(ErrorType.INVALID_ROW, f"line is not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(value, dict):
        return RowError(ErrorType.INVALID_ROW, f"line is a JSON {type(value).__name__}, expected an object")
    return value


_BATCH_KEYS = ("custom_id", "method", "url", "body")
_BATCH_URL = "/v1/chat/completions"


def _is_openai_batch_line(obj: dict[str, Any]) -> bool:
    return all(key in obj for key in _BATCH_KEYS)


def _openai_batch_row(obj: dict[str, Any]) -> dict[str, Any] | RowError:
    """Map one OpenAI Batch request line to the row contract (custom_id, messages, overrides,
    `response_format` / `guided_*`, vLLM's `mm_processor_kwargs`)."""
    missing = [key for key in _BATCH_KEYS if key not in obj]
    if missing:
        return RowError(ErrorType.INVALID_ROW, f"OpenAI Batch line lacks {', '.join(missing)}")
    if obj["url"] != _BATCH_URL or str(obj["method"]).upper() != "POST":
        return RowError(ErrorType.INVALID_ROW, f"only POST {_BATCH_URL} is supported, got {obj['method']} {obj['url']}")
    body = obj["body"]
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return RowError(ErrorType.INVALID_ROW, "body.messages must be a list of chat messages", "body.messages")
    if refuses_tools(body.get("tools"), body.get("tool_choice")):  # as `serve` answers them
        return RowError(ErrorType.INVALID_ROW, TOOLS_REFUSED, "body.tools")
    row: dict[str, Any] = {"custom_id": obj["custom_id"], "messages": body["messages"]}
    if "max_completion_tokens" in body:
        row["max_tokens"] = body["max_completion_tokens"]
    row.update({key: body[key] for key in (*SAMPLING_OVERRIDE_KEYS, *STRUCTURED_KEYS, "mm_processor_kwargs") if key in body})
    return row


def _chunks(handle: BinaryIO, start: int, end: int | None) -> Iterator[bytes]:
    """The bytes [start, end) of a file (end None: to its end), in chunks of doubling size."""
    handle.seek(start)
    position, size = start, FIRST_CHUNK_BYTES
    while end is None or position < end:
        chunk = handle.read(size if end is None else min(size, end - position))
        if not chunk:
            return
        position += len(chunk)
        yield chunk
        size = min(size * 2, LARGEST_CHUNK_BYTES)


def _lines_in(handle: BinaryIO, start: int, end: int | None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line in the bytes [start, end), newline included.

    Plans put `start` and `end` on line starts, so the range holds whole lines.
    """
    position = start
    partial: list[bytes] = []  # the start of a line that continues in the next chunk
    for chunk in _chunks(handle, start, end):
        begin = 0
        while (newline := chunk.find(b"\n", begin)) >= 0:
            line = chunk[begin : newline + 1]
            if partial:
                line, partial = b"".join(partial) + line, []
            yield position, line
            position += len(line)
            begin = newline + 1
        if begin < len(chunk):
            partial.append(chunk[begin:])
    if partial:
        yield position, b"".join(partial)


def _next_line_start(handle: BinaryIO, offset: int, size: int) -> int:
    """The first line start at or after `offset`: just past the first newline from
    `offset - 1` on, found in a window that doubles until it holds one (or the file ends)."""
    position = offset - 1
    for chunk in _chunks(handle, position, size):
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
    return size


class JsonlReader(DatasetReader):
    """JSON Lines, including OpenAI Batch request files (rows mapped to the contract).

    A local file is planned by one counting scan (row ids are row numbers); an object is
    planned by windows around split points, never read whole (row ids are line offsets).
    """

    def __init__(self, path: Location, columns: ColumnMap):
        super().__init__(path, columns)
        self._num_rows: int | None = None
        self._counted = not isinstance(path, ObjectPath)
        sample, seen_lines, sample_bytes = self._read_sample()
        self._mean_line_bytes = sample_bytes / seen_lines if seen_lines else 0.0
        self.format = FORMAT_OPENAI_BATCH if sample and _is_openai_batch_line(sample[0]) else FORMAT_JSONL
        if self.format == FORMAT_OPENAI_BATCH:
            self.columns = ColumnMap(id="custom_id")
            sample = [row for row in map(_openai_batch_row, sample) if not isinstance(row, RowError)]
        if seen_lines and not sample:
            raise JobError(f"{path}: none of the first {seen_lines} lines is a usable JSON object; is it JSON Lines?")
        self._column_names = list(dict.fromkeys(key for row in sample for key in row))
        # Only passthrough candidates are kept: media and messages can be large.
        self._sample = [{k: v for k, v in row.items() if self._is_passthrough_candidate(k)} for row in sample]
        if seen_lines:
            self._validate_columns()

    def _read_sample(self) -> tuple[list[dict[str, Any]], int, int]:
        """The parseable objects among the leading lines (bounded by SAMPLE_ROWS and
        SAMPLE_BYTES), how many lines were seen and their bytes."""
        rows: list[dict[str, Any]] = []
        seen = budget = 0
        for _, line in self._lines(0, None):
            seen += 1
            budget += len(line)
            row = _parse_json_object(line)
            if not isinstance(row, RowError):
                rows.append(row)
            if seen >= SAMPLE_ROWS or budget >= SAMPLE_BYTES:
                break
        return rows, seen, budget

    @property
    def column_names(self) -> list[str]:
        return self._column_names

    def _scan(self, shard_size: int | None) -> tuple[int, list[int], int]:
        """Count rows and record the byte offset of every shard_size-th row; returns (rows, offsets, end)."""
        starts: list[int] = []
        rows = 0
        end = 0
        with open_input(self.path) as handle:
            for position, line in _lines_in(handle, 0, None):
                if line.strip():
                    if shard_size and rows % shard_size == 0:
                        starts.append(position)
                    rows += 1
                end = position + len(line)
        self._num_rows = rows
        return rows, starts, end

    def num_rows(self) -> int:
        """Counted by reading the whole file (planning an object never does this)."""
        if self._num_rows is None:
            self._scan(None)
        assert self._num_rows is not None
        return self._num_rows

    def plan_shards(self, shard_size: int) -> list[ShardPlan]:
        _check_shard_size(shard_size)
        if not self._counted:
            return self._plan_by_windows(shard_size)
        rows, starts, end = self._scan(shard_size)
        bounds = starts + [end]
        return [
            ShardPlan(
                shard_id=index,
                row_start=index * shard_size,
                row_end=min(rows, (index + 1) * shard_size),
                byte_start=bounds[index],
                byte_end=bounds[index + 1],
            )
            for index in range(len(starts))
        ]

    def _plan_by_windows(self, shard_size: int) -> list[ShardPlan]:
        """Shards of about `shard_size` rows (by the sample's mean line length), each
        boundary moved to the next line start by one small ranged read."""
        if not self._mean_line_bytes:
            return []
        target = max(1, round(shard_size * self._mean_line_bytes))
        with open_input(self.path) as handle:
            size = handle.seek(0, 2)
            bounds = [0]
            while bounds[-1] + target < size:
                start = _next_line_start(handle, bounds[-1] + target, size)
                if start >= size:
                    break
                bounds.append(start)
        bounds.append(size)
        return [
            ShardPlan(shard_id=index, row_start=low, row_end=high, byte_start=low, byte_end=high, row_ids=ROW_IDS_BYTE_OFFSET)
            for index, (low, high) in enumerate(zip(bounds, bounds[1:]))
        ]

    def iter_shard(self, plan: ShardPlan, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        if plan.byte_start is None or plan.byte_end is None:
            raise ValueError(f"shard {plan.shard_id} has no byte range: not a JSONL plan")
        return self._batches(plan.byte_start, plan.byte_end, plan.row_start, batch_size)

    def iter_rows(self, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        return self._batches(0, None, 0, batch_size)

    def _lines(self, byte_start: int, byte_end: int | None) -> Iterator[tuple[int, bytes]]:
        """(offset, line) of the non-blank lines in [byte_start, byte_end) (None: to the end)."""
        with open_input(self.path) as handle:
            for position, line in _lines_in(handle, byte_start, byte_end):
                if line.strip():
                    yield position, line

    def _batches(self, byte_start: int, byte_end: int | None, first_row_id: int, batch_size: int) -> Iterator[RowBatch]:
        lines = self._lines(byte_start, byte_end)
        if self._counted:
            rows = ((row_id, self._parse_line(line)) for row_id, (_, line) in enumerate(lines, start=first_row_id))
        else:
            rows = ((position, self._parse_line(line)) for position, line in lines)
        while batch := list(islice(rows, batch_size)):
            yield batch

    def _parse_line(self, line: bytes) -> dict[str, Any] | RowError:
        row = _parse_json_object(line)
        if isinstance(row, RowError) or self.format != FORMAT_OPENAI_BATCH:
            return row
        return _openai_batch_row(row)

    def passthrough_schema(self) -> pa.Schema:
        candidates = [name for name in self._column_names if self._is_passthrough_candidate(name)]
        result = []
        for name in candidates:
            arrow_type = infer_scalar_type([row.get(name) for row in self._sample])
            if arrow_type is not None:
                result.append(pa.field(name, arrow_type))
        return pa.schema(result)


class ParquetReader(DatasetReader):
    """Parquet (HF `Image` columns arrive as {"bytes", "path"} dicts).

    Rows stream through `ParquetFile.iter_batches`, which decodes one row group at a
    time: memory is bounded by the largest row group the file was written with.
    """

    format = FORMAT_PARQUET

    def __init__(self, path: Location, columns: ColumnMap):
        super().__init__(path, columns)
        try:
            self._file = pq.ParquetFile(parquet_source(path))
        except (pa.ArrowException, OSError) as exc:
            raise JobError(f"{path}: not a readable Parquet file ({exc})") from exc
        metadata = self._file.metadata
        self._group_starts = [0]
        for index in range(metadata.num_row_groups):
            self._group_starts.append(self._group_starts[-1] + metadata.row_group(index).num_rows)
        self._validate_columns()

    @property
    def column_names(self) -> list[str]:
        return list(self._file.schema_arrow.names)

    def num_rows(self) -> int:
        return self._file.metadata.num_rows

    def plan_shards(self, shard_size: int) -> list[ShardPlan]:
        _check_shard_size(shard_size)
        total = self.num_rows()
        plans = []
        for index, row_start in enumerate(range(0, total, shard_size)):
            row_end = min(total, row_start + shard_size)
            groups = [
                group
                for group in range(len(self._group_starts) - 1)
                if self._group_starts[group] < row_end and self._group_starts[group + 1] > row_start
            ]
            plans.append(ShardPlan(shard_id=index, row_start=row_start, row_end=row_end, row_groups=groups))
        return plans

    def iter_shard(self, plan: ShardPlan, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        if plan.row_groups is None:
            raise ValueError(f"shard {plan.shard_id} has no row groups: not a Parquet plan")
        return self._iter_range(plan.row_start, plan.row_end, plan.row_groups, batch_size)

    def iter_rows(self, batch_size: int = DEFAULT_BATCH_SIZE) -> Iterator[RowBatch]:
        return self._iter_range(0, self.num_rows(), list(range(len(self._group_starts) - 1)), batch_size)

    def _iter_range(self, row_start: int, row_end: int, row_groups: list[int], batch_size: int) -> Iterator[RowBatch]:
        if not row_groups or row_end <= row_start:
            return
        position = self._group_starts[row_groups[0]]
        for record_batch in self._file.iter_batches(batch_size=batch_size, row_groups=row_groups):
            batch_start = position
            position += record_batch.num_rows
            low = max(row_start - batch_start, 0)
            high = min(row_end - batch_start, record_batch.num_rows)
            if high > low:
                rows = record_batch.slice(low, high - low).to_pylist()
                yield [(batch_start + low + offset, row) for offset, row in enumerate(rows)]
            if position >= row_end:
                break

    def passthrough_schema(self) -> pa.Schema:
        return pa.schema(
            [
                field
                for field in self._file.schema_arrow
                if self._is_passthrough_candidate(field.name) and is_passthrough_type(field.type)
            ]
        )


def detect_format(path: Location, head: bytes) -> str:
    """`jsonl` or `parquet` from the extension, else from the first bytes."""
    suffix = Path(path.name).suffix.lower()
    if suffix in PARQUET_EXTENSIONS or head.startswith(PARQUET_MAGIC):
        return FORMAT_PARQUET
    if suffix in JSONL_EXTENSIONS or head.lstrip().startswith(b"{"):
        return FORMAT_JSONL
    raise JobError(f"{path}: unknown dataset format (expected .jsonl/.json JSON Lines or .parquet)")


def open_dataset(
    path: str | Location,
    columns: ColumnMap | None = None,
    format: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> DatasetReader:
    """Open and validate a dataset (a local path or an object-storage URL); every
    job-level problem raises a one-line `JobError` that names it.

    `format` (a manifest's recorded format) skips detection; JSONL and OpenAI Batch
    share one reader, which tells them apart by the lines themselves.
    """
    path = resolve(path, storage_options)
    try:
        kind = _file_kind(path)
        if kind == pafs.FileType.NotFound:
            raise JobError(f"dataset not found: {path}")
        if kind != pafs.FileType.File:
            raise JobError(f"dataset is not a file: {path}")
        with open_input(path) as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise JobError(f"cannot read dataset {path}: {exc.strerror or exc}") from exc
    if format is not None and format not in (FORMAT_JSONL, FORMAT_OPENAI_BATCH, FORMAT_PARQUET):
        raise JobError(f"unknown dataset format {format!r}")
    columns = columns or ColumnMap()
    if (format or detect_format(path, head)) == FORMAT_PARQUET:
        return ParquetReader(path, columns)
    return JsonlReader(path, columns)


def _file_kind(path: Location) -> pafs.FileType:
    if isinstance(path, ObjectPath):
        return path.info().type
    if not path.exists():
        return pafs.FileType.NotFound
    return pafs.FileType.File if path.is_file() else pafs.FileType.Directory
