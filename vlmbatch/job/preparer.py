"""Row preparation in worker processes, so image decoding never starves the engine.

Decoding, resizing and normalising media is CPU work that holds the GIL: one Python
thread manages a few dozen 1080p images/s (~38 ms of CPU each with Qwen's processor) while
the GPU waits. Here each worker process of a `ProcessPool` builds the model's adapter once
and prepares rows (`prepare_row`) as they come; rows are delivered as soon as they are
ready, out of order (results are attributed by `row_id`).

Promises, each covered by tests/test_pool_prepare.py and tests/test_pool_reuse.py (the
pool's own, bounded memory and crash isolation among them, are in `process_pool`):
- the rows equal those prepared in the engine's thread; a row that kills its worker is
  that row's `worker_crash` error, one that hangs past `row_timeout` its `media_timeout`;
- a pool outlives one source: `RowPreparer` keeps one for the life of its owner (a
  `vlmbatch worker` GPU process, an in-process job), so shards do not pay start-up and the
  adapter load again. The job's settings travel with each row (`RowPreparation`), so the
  same workers serve shard after shard of any job;
- a job whose videos decode on the GPU, and a preparer of 0 workers, prepare rows in the
  caller's thread, in order;
- a worker's torch ops and video decoders use one thread each: the pool is the parallelism.
"""
from __future__ import annotations

import os
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmbatch.config import MediaConfig, WorkerConfig
from vlmbatch.errors import RowError
from vlmbatch.job.process_pool import PoolStartError, ProcessPool, Task, start_fork_server

if TYPE_CHECKING:
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.job.prepare import PreparedRow
    from vlmbatch.families.adapter import ModelAdapter

# A row still being prepared after this long has hung its worker (a stuck decoder): the
# worker is killed and the row fails with `media_timeout`. Far above any real row (a long
# video takes seconds), so it only ever catches hangs.
DEFAULT_ROW_TIMEOUT = 600.0
# Modules the fork server imports once, so each (re)started worker skips their import time:
# without them a worker's first `load_adapter` spends ~13 s importing torchvision (via the
# image processors) on this machine, with them 0.2 s.
PRELOAD = (
    "torch",
    "torchvision",
    "transformers.image_processing_utils",
    "transformers.video_processing_utils",
    "transformers.processing_utils",
    "transformers.models.auto.processing_auto",
    "vlmbatch.families.registry",
    "vlmbatch.job.prepare",
    "vlmbatch.job.preparer",
)


def default_num_workers(worker: WorkerConfig) -> int:
    """`worker.preprocess_workers` when set, else this process's cores less those left to
    the engine.

    This process's cores are its share of the host (`vlmbatch worker` gives each GPU worker
    its own: `worker.worker_cpus`), else its affinity. The engine keeps two of them when
    it can (its Python loop, plus the CUDA, pinned-copy and queue heartbeat threads), one
    otherwise: a 16-core host with two GPU workers gets 6 preprocessing processes per GPU.
    """
    if worker.preprocess_workers is not None:
        return worker.preprocess_workers
    cores = len(worker.worker_cpus or os.sched_getaffinity(0))
    return max(1, cores - (2 if cores >= 4 else 1))


@dataclass(frozen=True)
class AdapterSpec:
    """What a worker process needs to build its own copy of the job's model adapter."""

    model: str
    chat_template: str | None = None
    trust_remote_code: bool = False

    def load(self) -> ModelAdapter:
        from vlmbatch.families.registry import load_adapter

        return load_adapter(self.model, self.chat_template, self.trust_remote_code)


@dataclass(frozen=True)
class RowPreparation:
    """Everything `prepare_row` needs besides the row (a job's settings); it travels with
    each row, so one pool serves shard after shard of any job (~1 KB per row).

    `adapter_spec` None validates media without a model (the queue benchmark). `media` is
    the owning process's media configuration: the workers load media as it would.
    `pixel_dtype` (a torch dtype name such as "bfloat16") is the engine's: its vision tower
    casts pixels to it first thing, so casting them in the worker gives the same results
    and halves the bytes that cross the pipe (a 448x448 image: 4.8 -> 2.4 MB). None keeps
    the processor's float32 (CPU engines, which run in float32).
    """

    adapter_spec: AdapterSpec | None
    dataset: str
    media_io_kwargs: dict[str, Any]
    columns: Any
    defaults: SamplingParams
    media: MediaConfig
    pixel_dtype: str | None = None
    defer_jpegs: bool = False  # JPEG bytes go to the engine for GPU decoding (engine/gpu_images.py)
    storage_options: dict[str, Any] = field(default_factory=dict)  # for s3:// media (the job's)

    @classmethod
    def for_job(cls, manifest: Any, adapter_spec: AdapterSpec | None, defaults: SamplingParams, media: MediaConfig,
                pixel_dtype: str | None = None, defer_jpegs: bool = False) -> RowPreparation:
        """The preparation of `manifest`'s rows."""
        return cls(adapter_spec, str(manifest.dataset), manifest.media_io_kwargs or {}, manifest.columns, defaults, media,
                   pixel_dtype, defer_jpegs, dict(manifest.storage_options))

    @property
    def videos_on_gpu(self) -> bool:
        """A job whose video backend decodes on the GPU: its rows are prepared in the engine
        process, as pool workers would each open a CUDA context the engine did not budget
        for and send the frames back through the host (docs/video.md)."""
        from vlmbatch.media.video import decodes_on_gpu

        return decodes_on_gpu(self.media_io_kwargs.get("video"), self.media)


class _RowHandler:
    """Prepares rows one at a time, each `(row_id, (preparation, raw))`; the adapter and the
    media loader are built once and rebuilt only when a row's preparation asks for other
    ones (another model spelling or chat template; another dataset or media options or
    configuration)."""

    def __init__(self, adapter_spec: AdapterSpec | None, adapter: ModelAdapter | None = None, cast_pixels: bool = True):
        self.adapter_spec = adapter_spec
        self.adapter = adapter if adapter is not None or adapter_spec is None else adapter_spec.load()
        self.cast_pixels = cast_pixels
        self.media_for: tuple[Any, ...] | None = None
        self.media: Any = None

    def __call__(self, task: Task) -> PreparedRow:
        from vlmbatch.job.prepare import media_loader_for, prepare_row

        row_id, (preparation, raw) = task
        if preparation.adapter_spec != self.adapter_spec:
            self.adapter_spec = preparation.adapter_spec
            self.adapter = self.adapter_spec.load() if self.adapter_spec is not None else None
        if (preparation.dataset, preparation.media_io_kwargs, preparation.media, preparation.storage_options) != self.media_for:
            self.media_for = (preparation.dataset, preparation.media_io_kwargs, preparation.media, preparation.storage_options)
            self.media = media_loader_for(*self.media_for)
        item = prepare_row(row_id, raw, preparation.columns, preparation.defaults, self.adapter, self.media,
                           defer_jpegs=preparation.defer_jpegs)
        if self.cast_pixels and item.prepared is not None and preparation.pixel_dtype is not None:
            for media_item in item.prepared.media:
                media_item.cast_pixels(preparation.pixel_dtype)  # less to pickle
        return item


def use_one_thread() -> None:
    """For a pool worker: the pool is the parallelism, so torch ops use one thread (more
    would oversubscribe the cores) and so do video decoders (they also waste less after seeks)."""
    import torch

    from vlmbatch.media.video.options import set_cpu_decoder_threads

    torch.set_num_threads(1)
    set_cpu_decoder_threads(1)


def _worker_setup(adapter_spec: AdapterSpec | None) -> _RowHandler:
    """A pool worker's start: one thread each, then the adapter, loaded now."""
    use_one_thread()
    return _RowHandler(adapter_spec)


def _failed_row(task: Task, error_type: str, message: str) -> PreparedRow:
    from vlmbatch.job.prepare import PreparedRow

    row_id, (_, raw) = task
    return PreparedRow(row_id=row_id, raw=raw, error=RowError(error_type, message))


class RowPreparer:
    """One preprocessing pool kept for the life of its owner and reused by every shard.

    A `vlmbatch worker` GPU process holds one for all the shards (of every job) it runs, and
    an in-process job one for all its shards: the workers start and load the adapter once,
    not per shard. The pool is rebuilt only after it failed to start.

    It is built from the owner's configuration: `worker` sizes the pool (and says how much
    GPU memory decoded media of the rows in flight may hold, `job.shard.GpuMediaBudget`),
    `media` is how the rows' media are loaded. `max_pending` bounds the rows read from a
    source and not yet yielded (default 4 per worker). `starts` counts the pools started,
    `restarts` the workers replaced (crashes, timeouts, abandoned sources).
    """

    def __init__(self, worker: WorkerConfig, media: MediaConfig, *, max_pending: int | None = None,
                 row_timeout: float | None = DEFAULT_ROW_TIMEOUT):
        self.worker = worker
        self.media = media
        self.num_workers = default_num_workers(worker)
        self.max_pending = max_pending
        self.row_timeout = row_timeout
        self.pool: ProcessPool | None = None
        self.starts = 0
        self._restarts_before = 0  # of pools already closed

    def __enter__(self) -> RowPreparer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def restarts(self) -> int:
        return self._restarts_before + (self.pool.restarts if self.pool is not None else 0)

    def start_fork_server(self) -> None:
        """Start the fork server now (it imports `PRELOAD`: seconds), e.g. while the model
        loads, so the pool started after it forks its workers in ~0.5 s."""
        if self.num_workers > 0:
            start_fork_server(PRELOAD)

    def prepare(self, source: Iterable[Task], preparation: RowPreparation,
                adapter: ModelAdapter | None = None) -> Generator[PreparedRow | None, bool | None, None]:
        """Prepared rows of `source`, in completion order.

        Through the pool, `send(False)` instead of `next()` returns None when no row is
        ready instead of waiting (`ProcessPool.imap_unordered`). Without it (0 workers, or
        videos decoded on the GPU) rows are prepared here, in order, with `adapter` (the
        caller's loaded one) or one loaded from the preparation's spec.
        """
        if self.num_workers == 0 or preparation.videos_on_gpu:
            yield from _prepare_here(source, preparation, adapter)
            return
        self.start(preparation.adapter_spec)
        assert self.pool is not None
        try:
            yield from self.pool.imap_unordered((row_id, (preparation, raw)) for row_id, raw in source)
        except PoolStartError:
            self.close()  # a worker that cannot start would fail every later shard the same way
            raise

    def start(self, adapter_spec: AdapterSpec | None) -> None:
        """Start the workers unless they run (each loads `adapter_spec`'s processor): a GPU
        worker calls it once its model is loaded, so its first shard finds them ready."""
        if self.pool is None and self.num_workers > 0:
            pool = ProcessPool(_worker_setup, adapter_spec, _failed_row, self.num_workers, self.max_pending,
                               task_timeout=self.row_timeout, preload=PRELOAD)
            self.pool = pool.__enter__()
            self.starts += 1

    def close(self) -> None:
        """Stop the workers (the owner is done)."""
        if self.pool is not None:
            self._restarts_before += self.pool.restarts
            self.pool.close()
            self.pool = None


def _prepare_here(source: Iterable[Task], preparation: RowPreparation, adapter: ModelAdapter | None) -> Iterator[PreparedRow]:
    """In this thread, in order; pixels keep the processor's dtype (nothing is pickled)."""
    handle = _RowHandler(preparation.adapter_spec, adapter, cast_pixels=False)
    for row_id, raw in source:
        yield handle((row_id, (preparation, raw)))
