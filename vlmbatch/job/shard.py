"""Run one shard: stream its rows through media loading and the engine, write one part.

The same function serves the in-process runner and the Celery task, so both paths
produce identical results. Rows flow through the engine continuously (new rows are
added as others finish) instead of in barrier-separated micro-batches, so the engine
stays full; `should_stop` is polled between engine steps, which is how a cancel
stops a running shard without committing a partial part.
"""

from __future__ import annotations

import time
from contextlib import closing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vlmbatch.engine.outputs import RequestOutput
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.job.pool import AdapterSpec, prepare_rows_parallel
from vlmbatch.media.gpu_batch import defer_jpegs_for
from vlmbatch.job.prepare import PreparedRow
from vlmbatch.job.rows import RowRequest

STOP_POLL_SECONDS = 0.5


@dataclass
class ShardOutcome:
    shard_id: int
    rows_ok: int = 0
    rows_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    stopped: bool = False
    part_path: Path | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)


class ResultRowFactory:
    """Builds result rows with the manifest's fixed columns filled in."""

    def __init__(self, manifest: Any, shard_id: int, attempt: int):
        self.id_column = manifest.result_id_column
        self.input_id_column = manifest.columns.id
        self.passthrough = list(manifest.passthrough_schema.names)
        self.model = manifest.model
        self.shard_id = shard_id
        self.attempt = attempt

    def _base(self, row_id: int, raw: dict[str, Any] | None, request: RowRequest | None) -> dict[str, Any]:
        raw = raw if isinstance(raw, dict) else {}
        row_key = request.id if request is not None else raw.get(self.input_id_column)
        row = {
            "row_id": row_id,
            self.id_column: str(row_key) if row_key is not None else str(row_id),
            "model": self.model,
            "shard_id": self.shard_id,
            "attempt": self.attempt,
            "finished_at": datetime.now(timezone.utc),
        }
        for name in self.passthrough:
            row[name] = raw.get(name)
        return row

    def ok(self, item: PreparedRow, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        row = self._base(item.row_id, item.raw, item.request)
        row.update(
            generated_text=completion.text,
            finish_reason=completion.finish_reason or "length",
            num_input_tokens=output.num_input_tokens,
            num_generated_tokens=len(completion.token_ids),
            error_type=None,
            error=None,
        )
        return row

    def validated(self, item: PreparedRow) -> dict[str, Any]:
        """A row that passed validation in a no-generation run (dry-run, queue benchmark)."""
        row = self._base(item.row_id, item.raw, item.request)
        row.update(
            generated_text=None,
            finish_reason=None,
            num_input_tokens=item.prepared.num_tokens if item.prepared else None,
            num_generated_tokens=0,
            error_type=None,
            error=None,
        )
        return row

    def failed(self, item: PreparedRow, error: RowError) -> dict[str, Any]:
        row = self._base(item.row_id, item.raw, item.request)
        row.update(
            generated_text=None,
            finish_reason="error",
            num_input_tokens=item.prepared.num_tokens if item.prepared else None,
            num_generated_tokens=0,
            error_type=error.error_type,
            error=error.message,
        )
        return row


def run_shard(
    manifest: Any,
    job_dir: Path,
    shard_id: int,
    llm: Any | None,
    *,
    attempt: int = 1,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    retry_errors: bool = False,
    row_range: tuple[int, int] | None = None,
    commit: bool = True,
    max_inflight: int | None = None,
) -> ShardOutcome:
    """Generate every row of shard `shard_id` and (if `commit`) write its part atomically.

    `llm=None` validates rows (parse, media, prompt length via the adapter passed as
    `manifest`'s model is not loaded) without generating: the queue benchmark uses it.
    `retry_errors` re-runs only the rows of the committed part that ended in an error.
    `row_range` restricts the run to a sub-range (poison-shard splitting).
    """
    import pyarrow.parquet as pq

    from vlmbatch.io.readers import open_dataset
    from vlmbatch.io.writer import write_part

    plan = manifest.shards[shard_id]
    factory = ResultRowFactory(manifest, shard_id, attempt)
    outcome = ShardOutcome(shard_id=shard_id)
    kept: list[dict[str, Any]] = []
    only_rows: set[int] | None = None
    if retry_errors:
        previous = pq.read_table(manifest.part_path(shard_id)).to_pylist()
        kept = [r for r in previous if r["error_type"] is None]
        only_rows = {r["row_id"] for r in previous if r["error_type"] is not None}

    reader = open_dataset(manifest.dataset, manifest.columns)
    source = _rows_in_range(reader.iter_shard(plan), row_range, only_rows)
    defaults = SamplingParams(**manifest.sampling)
    adapter = llm.adapter if llm is not None else None
    spec = AdapterSpec(manifest.model, manifest.extra.get("chat_template")) if adapter is not None else None
    defer = llm is not None and defer_jpegs_for(llm.engine, manifest.extra.get("gpu_image_decode"))  # media/gpu_batch.py
    prepared = prepare_rows_parallel(source, manifest, spec, defaults, adapter=adapter, defer_jpegs=defer)

    def record(row: dict[str, Any], ok: bool) -> None:
        outcome.rows.append(row)
        if ok:
            outcome.rows_ok += 1
            outcome.input_tokens += row["num_input_tokens"] or 0
            outcome.output_tokens += row["num_generated_tokens"] or 0
        else:
            outcome.rows_failed += 1
        if on_progress:
            on_progress(1 if ok else 0, 0 if ok else 1)

    with closing(prepared):  # an early stop (cancel) shuts the preprocessing workers down
        if llm is None:
            finished = _validate_only(prepared, factory, record, should_stop)
        else:
            finished = _generate(llm, prepared, factory, record, should_stop, max_inflight)
    if not finished:
        outcome.stopped = True
        return outcome

    outcome.rows.extend(kept)
    outcome.rows.sort(key=lambda r: r["row_id"])
    if commit:
        outcome.part_path = write_part(job_dir, shard_id, manifest.num_shards, outcome.rows)
        outcome.rows = []
    return outcome


def _rows_in_range(
    batches: Iterator[list[tuple[int, Any]]], row_range: tuple[int, int] | None, only_rows: set[int] | None
) -> Iterator[tuple[int, Any]]:
    for batch in batches:
        for row_id, raw in batch:
            if row_range is not None and not row_range[0] <= row_id < row_range[1]:
                continue
            if only_rows is not None and row_id not in only_rows:
                continue
            yield row_id, raw


def _validate_only(
    prepared: Iterator[PreparedRow],
    factory: ResultRowFactory,
    record: Callable[[dict[str, Any], bool], None],
    should_stop: Callable[[], bool] | None,
) -> bool:
    """Rows without generation (queue benchmark): parse and media checks only."""
    for item in prepared:
        if item.error is not None:
            record(factory.failed(item, item.error), False)
        else:
            record(factory.validated(item), True)
        if should_stop is not None and should_stop():
            return False
    return True


def _generate(
    llm: Any,
    prepared: Iterator[PreparedRow],
    factory: ResultRowFactory,
    record: Callable[[dict[str, Any], bool], None],
    should_stop: Callable[[], bool] | None,
    max_inflight: int | None,
) -> bool:
    """Keep the engine full from `prepared`; return False if stopped before the end."""
    engine = llm.engine
    limit = max_inflight or getattr(llm, "max_inflight", 256)
    inflight: dict[str, PreparedRow] = {}
    exhausted = False
    last_poll = time.monotonic()
    while True:
        while not exhausted and len(inflight) < limit:
            item = next(prepared, None)
            if item is None:
                exhausted = True
                break
            if item.error is not None:
                record(factory.failed(item, item.error), False)
                continue
            request_id = str(item.row_id)
            engine.add_request(request_id, item.prepared, item.sampling)
            inflight[request_id] = item
        if not inflight:
            return True
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad row must not end the shard
            for request_id in list(inflight):
                engine.abort_request(request_id)
            _isolate(llm, inflight, factory, record, exc)
            inflight.clear()
            continue
        for output in outputs:
            if output.finished and output.request_id in inflight:
                record(factory.ok(inflight.pop(output.request_id), output), True)
        if should_stop is not None and time.monotonic() - last_poll > STOP_POLL_SECONDS:
            last_poll = time.monotonic()
            if should_stop():
                for request_id in list(inflight):
                    engine.abort_request(request_id)
                return False


def _isolate(
    llm: Any,
    inflight: dict[str, PreparedRow],
    factory: ResultRowFactory,
    record: Callable[[dict[str, Any], bool], None],
    batch_error: Exception,
) -> None:
    """After an engine failure on a batch, rerun its rows one by one to find the bad ones."""
    for request_id, item in inflight.items():
        try:
            output = llm.run([(request_id, item.prepared, item.sampling)])[request_id]
        except Exception as exc:  # noqa: BLE001
            error = RowError(ErrorType.ENGINE, f"{type(exc).__name__}: {exc}")
            record(factory.failed(item, error), False)
        else:
            record(factory.ok(item, output), True)
