"""Run one shard: stream its rows through media loading and the engine, write one part.

The same function serves the in-process runner and the Celery task, so both paths
produce identical results. Rows flow through the engine continuously (new rows are
added as others finish) instead of in barrier-separated micro-batches, so the engine
stays full; `should_stop` is polled between engine steps, which is how a cancel
stops a running shard without committing a partial part. While the engine has requests
in flight it takes only rows that are already prepared, and never waits for one.

Each shard logs one `shard timing` line (rows, seconds, time the engine sat idle waiting
for prepared rows, time in engine steps, preprocessing pool starts): `vlmbatch bench
scaling` reads them from the worker logs to show where a shard's time went.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import closing
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vlmbatch.engine.outputs import RequestOutput
from vlmbatch.io.output_schema import job_output_column, job_spec, structured_text
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.engine.gpu_images import defers_image_decoding
from vlmbatch.job.preparer import AdapterSpec, RowPreparation, RowPreparer
from vlmbatch.job.prepare import PreparedRow
from vlmbatch.job.rows import RowRequest

log = logging.getLogger(__name__)

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
    timing: ShardTiming = field(default_factory=lambda: ShardTiming())


@dataclass
class ShardTiming:
    """Where a shard's wall time went (seconds)."""

    seconds: float = 0.0
    idle_for_rows: float = 0.0  # nothing in flight, waiting for the next prepared row
    engine: float = 0.0  # inside `engine.step()`
    pool_workers: int = 0  # processes of the shard's `RowPreparer` (0: none, or rows prepared in-thread)
    pool_starts: int = 0  # pools started for this shard: 1 for a process's first, then 0 (reused)
    worker_restarts: int = 0  # pool workers replaced during this shard (crashes, timeouts, abandons)

    def line(self, job_id: str, shard_id: int, rows: int, slot: str = "-") -> str:
        """One parseable log line (`key=value` pairs); `slot` is the worker process's GPU."""
        rate = rows / self.seconds if self.seconds > 0 else 0.0
        return (f"shard timing: job={job_id} shard={shard_id} pid={os.getpid()} "
                f"gpu={slot} rows={rows} seconds={self.seconds:.3f} "
                f"rows_per_s={rate:.2f} idle_for_rows={self.idle_for_rows:.3f} engine={self.engine:.3f} "
                f"pool_workers={self.pool_workers} pool_starts={self.pool_starts} worker_restarts={self.worker_restarts}")


class ResultRowFactory:
    """Builds result rows with the manifest's fixed columns filled in: one per sample of a
    row (`sample_index`) in jobs with n > 1, `logprobs` in jobs that asked for them
    (`tokenizer` writes their token texts)."""

    def __init__(self, manifest: Any, shard_id: int, attempt: int, tokenizer: Any = None):
        from vlmbatch.engine.logprobs import TokenTexts
        from vlmbatch.io.schema import SAMPLING_COLUMNS_KEY

        asked = manifest.extra.get(SAMPLING_COLUMNS_KEY, [])
        self.samples = "sample_index" in asked
        self.token_texts = TokenTexts(tokenizer) if "logprobs" in asked and tokenizer is not None else None
        self.id_column = manifest.result_id_column
        self.input_id_column = manifest.columns.id
        self.passthrough = list(manifest.passthrough_schema.names)
        self.model = manifest.model
        self.output = job_output_column(manifest.extra)  # a structured job's `output` / `output_json`
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
        if self.samples:
            row["sample_index"] = 0  # a row that failed (or was only validated) has one result row
        return row

    def ok(self, item: PreparedRow, output: RequestOutput) -> list[dict[str, Any]]:
        """The row's result rows: one per sample where the job has `sample_index`, else the
        first. A sample the engine failed after admission (an incomplete structured output,
        an uncompilable row spec) keeps its text and carries its error."""
        rows = []
        for completion in output.outputs if self.samples else output.outputs[:1]:
            error = completion.error
            row = self._base(item.row_id, item.raw, item.request)
            row.update(
                generated_text=completion.text if completion.finish_reason != "error" else None,
                finish_reason=completion.finish_reason or "length",
                num_input_tokens=output.num_input_tokens,
                num_generated_tokens=len(completion.token_ids),
                error_type=error.error_type if error is not None else None,
                error=error.message if error is not None else None,
                **structured_text(self.output, item.sampling.structured_output, completion.text),
            )
            if self.samples:
                row["sample_index"] = completion.index
            if self.token_texts is not None and completion.logprobs is not None:
                row["logprobs"] = self.token_texts.records(completion.logprobs)
            rows.append(row)
        return rows

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
    preparer: RowPreparer,
    attempt: int = 1,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    retry_errors: bool = False,
    row_range: tuple[int, int] | None = None,
    commit: bool = True,
    max_inflight: int | None = None,
    slot: str = "-",
) -> ShardOutcome:
    """Generate every row of shard `shard_id` and (if `commit`) write its part atomically.

    `llm=None` validates rows (parse, media, prompt length via the adapter passed as
    `manifest`'s model is not loaded) without generating: the queue benchmark uses it.
    `retry_errors` re-runs only the rows of the committed part that ended in an error.
    `row_range` restricts the run to a sub-range (poison-shard splitting).
    `preparer` is the caller's preprocessing pool, kept across shards, built from the
    process's worker and media configuration. JPEGs go to the engine undecoded as its
    `EngineConfig.gpu_image_decode` says, unless the job says otherwise (`submit
    --gpu-image-decode`). `slot` names the process's GPU in the shard's timing line.
    `on_row` sees each result row as it is made (a worker's metrics).
    """
    from vlmbatch.io.results import read_part
    from vlmbatch.io.writer import write_part

    started = time.monotonic()
    starts, restarts = preparer.starts, preparer.restarts
    plan = manifest.shards[shard_id]
    factory = ResultRowFactory(manifest, shard_id, attempt, llm.tokenizer if llm is not None else None)
    outcome = ShardOutcome(shard_id=shard_id)
    kept: list[dict[str, Any]] = []
    only_rows: set[int] | None = None
    if retry_errors:
        previous = read_part(manifest.part_path(shard_id)).to_pylist()
        kept = [r for r in previous if r["error_type"] is None]
        only_rows = {r["row_id"] for r in previous if r["error_type"] is not None}

    reader = manifest.open_dataset()
    source = _rows_in_range(reader.iter_shard(plan), row_range, only_rows)
    defaults = replace(SamplingParams(**manifest.sampling), structured_output=job_spec(manifest.extra))
    adapter = llm.adapter if llm is not None else None
    spec = AdapterSpec(manifest.model, manifest.extra.get("chat_template")) if adapter is not None else None
    defer = llm is not None and defers_image_decoding(llm.engine, image_decode_mode(manifest, llm.engine))
    preparation = RowPreparation.for_job(manifest, spec, defaults, preparer.media, pixel_dtype=pixel_dtype(llm),
                                         defer_jpegs=defer)
    prepared = preparer.prepare(source, preparation, adapter)

    def record(row: dict[str, Any] | list[dict[str, Any]], ok: bool) -> None:
        """One input row's result: a row, or its samples' rows."""
        rows = row if isinstance(row, list) else [row]
        ok = ok and all(r["error_type"] is None for r in rows)
        outcome.rows.extend(rows)
        if ok:
            outcome.rows_ok += 1
            outcome.input_tokens += rows[0]["num_input_tokens"] or 0
            outcome.output_tokens += sum(r["num_generated_tokens"] or 0 for r in rows)
        else:
            outcome.rows_failed += 1
        if on_progress:
            on_progress(1 if ok else 0, 0 if ok else 1)
        if on_row:
            for result in rows:
                on_row(result)

    with closing(prepared):  # an early stop (cancel) shuts the preprocessing workers down
        if llm is None:
            finished = _validate_only(prepared, factory, record, should_stop)
        else:
            budget = GpuMediaBudget(preparer.worker.gpu_media_budget_bytes)
            finished = _generate(llm, prepared, factory, record, should_stop, max_inflight, budget, outcome.timing)
    timing = outcome.timing
    timing.seconds = time.monotonic() - started
    timing.pool_workers = preparer.num_workers
    timing.pool_starts, timing.worker_restarts = preparer.starts - starts, preparer.restarts - restarts
    log.info(timing.line(manifest.job_id, shard_id, outcome.rows_ok + outcome.rows_failed, slot))
    if not finished:
        outcome.stopped = True
        return outcome

    outcome.rows.extend(kept)
    outcome.rows.sort(key=lambda r: r["row_id"])
    if commit:
        outcome.part_path = write_part(job_dir, shard_id, manifest.num_shards, outcome.rows, replace=retry_errors)
        outcome.rows = []
    return outcome


def image_decode_mode(manifest: Any, engine: Any) -> str:
    """A job's own `submit --gpu-image-decode` wins over the engine's configuration."""
    return manifest.extra.get("gpu_image_decode") or engine.config.gpu_image_decode


def pixel_dtype(llm: Any | None) -> str | None:
    """The engine's dtype when it is a half type ("bfloat16", "float16"), for the pool to
    send pixels in (see `RowPreparation`); None keeps float32. The paged engine's runner
    holds the model's dtype, the hf engine's HF model has it (the paged engine's HF model
    may hold no weights any more)."""
    import torch

    engine = getattr(llm, "engine", None)
    dtype = getattr(getattr(engine, "runner", None) or getattr(engine, "model", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype in (torch.bfloat16, torch.float16) else None


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
    record: Callable[[dict[str, Any] | list[dict[str, Any]], bool], None],
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
    prepared: Generator[PreparedRow | None, bool | None, None],
    factory: ResultRowFactory,
    record: Callable[[dict[str, Any] | list[dict[str, Any]], bool], None],
    should_stop: Callable[[], bool] | None,
    max_inflight: int | None,
    budget: GpuMediaBudget,
    timing: ShardTiming,
) -> bool:
    """Keep the engine full from `prepared`; return False if stopped before the end.

    With requests in flight only rows that are ready are taken (`send(False)`): waiting for
    the next row would idle the engine whenever preprocessing falls behind, e.g. at the
    start of a shard, until `limit` rows are prepared. Rows whose media already sit on the
    GPU (GPU video decoders) are also held back while those in flight hold more than the
    GPU media budget (`budget`)."""
    engine = llm.engine
    limit = max_inflight or getattr(llm, "max_inflight", 256)
    inflight: dict[str, PreparedRow] = {}
    held_back: PreparedRow | None = None  # taken from `prepared`, waiting for the budget
    exhausted = False
    last_poll = time.monotonic()
    while True:
        while (held_back is not None or not exhausted) and len(inflight) < limit:
            waited = time.monotonic()
            if held_back is not None:
                item, held_back = held_back, None
            else:
                try:
                    item = prepared.send(False) if inflight else next(prepared)  # in flight: it has started
                except StopIteration:
                    exhausted = True
                    break
            if not inflight:
                timing.idle_for_rows += time.monotonic() - waited
            if item is None:
                break  # none ready: step the engine
            if item.error is not None:
                record(factory.failed(item, item.error), False)
                continue
            media_bytes = item.prepared.device_media_bytes if item.prepared is not None else 0
            if not budget.admits(media_bytes):
                held_back = item
                break
            request_id = str(item.row_id)
            engine.add_request(request_id, item.prepared, item.sampling)
            inflight[request_id] = item
            budget.hold(request_id, media_bytes)
        if not inflight:
            return True
        stepped = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad row must not end the shard
            log.warning("engine step failed (%s: %s); rerunning its %d rows one by one", type(exc).__name__, exc, len(inflight))
            for request_id in list(inflight):
                engine.abort_request(request_id)
            _isolate(llm, inflight, factory, record)
            inflight.clear()
            budget.held.clear()
            continue
        finally:
            timing.engine += time.monotonic() - stepped
        for output in outputs:
            if output.finished and output.request_id in inflight:
                budget.release(output.request_id)
                record(factory.ok(inflight.pop(output.request_id), output), True)
        if should_stop is not None and time.monotonic() - last_poll > STOP_POLL_SECONDS:
            last_poll = time.monotonic()
            if should_stop():
                for request_id in list(inflight):
                    engine.abort_request(request_id)
                return False


@dataclass
class GpuMediaBudget:
    """Media already on the GPU waits there until the engine encodes it, outside the KV
    cache's memory plan: a 64-frame 720p row is ~430 MB. The rows in flight may hold at most
    `limit` bytes of it together; a row that would pass it waits, unless none is held
    (so an oversized row still runs, alone)."""

    limit: int
    held: dict[str, int] = field(default_factory=dict)  # request id -> bytes

    def admits(self, nbytes: int) -> bool:
        return not nbytes or not self.held or sum(self.held.values()) + nbytes <= self.limit

    def hold(self, request_id: str, nbytes: int) -> None:
        if nbytes:
            self.held[request_id] = nbytes

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)


def _isolate(
    llm: Any,
    inflight: dict[str, PreparedRow],
    factory: ResultRowFactory,
    record: Callable[[dict[str, Any] | list[dict[str, Any]], bool], None],
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
