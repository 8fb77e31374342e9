"""Row preparation in worker processes, so image decoding never starves the engine.

Decoding, resizing and normalising media is CPU work that holds the GIL: one Python
thread manages a few dozen 1080p images/s (~38 ms of CPU each with Qwen's processor) while
the GPU waits. Here each worker process builds the model's adapter once and prepares rows
(`prepare_row`) as they come; rows are delivered as soon as they are ready, out of order
(results are attributed by `row_id`).

Promises, each covered by tests/test_pool.py:
- bounded memory: at most `max_pending` rows are between the source and the consumer, and
  the source iterator is only advanced when there is room (a slow consumer slows reading);
- a worker that dies (decoder segfault, `os._exit`, OOM kill) fails only the row it was
  working on, as `ErrorType.WORKER_CRASH`; a row that runs past `task_timeout` fails as
  `ErrorType.MEDIA_TIMEOUT` and its worker is killed; either way the rows queued behind it
  go to other workers and the worker is replaced;
- closing the iterator (cancel, early `break`, garbage collection) stops the workers, and
  so does killing the process that owns the pool;
- a pool outlives one source: `RowPreparer` keeps one for the life of its owner (a
  `vlmbatch worker` GPU process, an in-process job), so shards do not pay start-up and the
  adapter load again. A source closed early kills the workers still holding its rows (their
  results can never reach the next source) and they are restarted when the next one starts.

Each worker has its own task queue (at most `_TASKS_PER_WORKER` rows deep) and its own
result pipe, which is what lets the parent know exactly which row a dead worker held; a
shared queue (`concurrent.futures.ProcessPoolExecutor`) loses that and breaks the whole pool
on one crash. Results travel as pickles through the pipe, not as torch shared memory
(container `/dev/shm` is often 64 MiB, which a few hundred rows of pixel tensors overflow),
with tensors pickled as raw bytes: torch's own pickling goes through `torch.save` and costs
~10x more (4.7 MB of pixel_values: ~25 ms vs ~2 ms of CPU per round trip here).
"""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from vlmbatch import config
from vlmbatch.errors import ErrorType, RowError

if TYPE_CHECKING:
    from vlmbatch.engine.sampling_params import SamplingParams
    from vlmbatch.job.prepare import PreparedRow
    from vlmbatch.families.adapter import ModelAdapter

# One row being prepared plus one waiting, so a worker never idles between rows while a
# slow row (a long video) holds back at most one other row.
_TASKS_PER_WORKER = 2
# A row still being prepared after this long has hung its worker (a stuck decoder): the
# worker is killed and the row fails with `media_timeout`. Far above any real row (a long
# video takes seconds), so it only ever catches hangs.
DEFAULT_ROW_TIMEOUT = 600.0
# How often an idle worker checks that the process that owns its pool still exists.
_ORPHAN_CHECK_SECONDS = 1.0
# Modules the fork server imports once, so each (re)started worker skips their import time:
# without them a worker's first `load_adapter` spends ~13 s importing torchvision (via the
# image processors) on this machine, with them 0.2 s.
_PRELOAD = [
    "torch",
    "torchvision",
    "transformers.image_processing_utils",
    "transformers.video_processing_utils",
    "transformers.processing_utils",
    "transformers.models.auto.processing_auto",
    "vlmbatch.families.registry",
    "vlmbatch.job.prepare",
    "vlmbatch.job.pool",
]

Task = tuple[int, Any]  # (row_id, payload)
Setup = Callable[[Any], Callable[[Task], Any]]  # setup(arg) -> handle(task) -> result
Failure = Callable[[Task, str, str], Any]  # on_failure(task, error_type, message) -> result


class PoolStartError(RuntimeError):
    """A worker failed before handling any row (its setup raised or it died): a job problem."""


def default_num_workers() -> int:
    """`VLMBATCH_PREPROCESS_WORKERS`, else this process's cores less those left to the engine.

    This process's cores are its share of the host (`vlmbatch worker` gives each GPU worker
    its own, see `config.worker_cpus`), else its affinity. The engine keeps two of them when
    it can (its Python loop, plus the CUDA, pinned-copy and queue heartbeat threads), one
    otherwise: a 16-core host with two GPU workers gets 6 preprocessing processes per GPU.
    """
    configured = config.preprocess_workers()
    if configured is not None:
        return configured
    cores = len(config.worker_cpus() or os.sched_getaffinity(0))
    return max(1, cores - (2 if cores >= 4 else 1))


class _TensorPickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes (any dtype, bf16 included)."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            # GPU tensors (a row overriding the video backend) cross through the host
            raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            return _tensor_from_bytes, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _tensor_from_bytes(raw: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(raw).view(dtype).reshape(shape)  # `raw` owns a writable copy of the received bytes


def _dumps(message: Any) -> memoryview:
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getbuffer()


def start_fork_server() -> None:
    """Start the fork server now (it imports `_PRELOAD` once: seconds), e.g. while the model
    loads; pools started later in this process fork their workers from it in ~0.5 s."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()


def _next_task(tasks: Any, owner_alive: Connection) -> Task | None:
    """The next task, or None at the sentinel or once the pool's owner is gone.

    A killed owner (`kill -9` of a job worker) cannot stop its pool, and nothing else
    would: the fork server hands every worker a handle that keeps the server alive, so
    neither a re-parenting nor the server's exit ever happens. The owner holds the only
    write end of `owner_alive` and never writes: readable means it has died."""
    while True:
        try:
            return tasks.get(timeout=_ORPHAN_CHECK_SECONDS)
        except queue.Empty:
            if owner_alive.poll():
                return None


def _worker_main(setup: Setup, setup_arg: Any, tasks: Any, results: Connection, owner_alive: Connection) -> None:
    """Build the handler once, then answer tasks until the `None` sentinel."""
    import torch

    from vlmbatch.media.video.options import set_cpu_decoder_threads

    torch.set_num_threads(1)  # the pool is the parallelism; per-op threads would oversubscribe
    set_cpu_decoder_threads(1)  # likewise for video decoders (and they waste less after seeks)
    try:
        handle = setup(setup_arg)
    except BaseException:  # noqa: BLE001 - any setup failure must reach the parent, not vanish
        results.send_bytes(_dumps(("setup_error", traceback.format_exc())))
        return
    results.send_bytes(_dumps(("ready", None)))
    while (task := _next_task(tasks, owner_alive)) is not None:
        try:
            message = ("result", handle(task))
        except Exception as exc:  # noqa: BLE001 - a bug on one row must not take the others down
            message = ("task_error", f"{type(exc).__name__}: {exc}")
        results.send_bytes(_dumps(message))


@dataclass(eq=False)
class _Worker:
    process: Any
    tasks: Any
    results: Connection
    held: deque[Task] = field(default_factory=deque)  # sent, not answered; held[0] is running
    ready: bool = False
    running_since: float | None = None  # monotonic start of held[0], once the worker is ready

    def advance(self) -> None:
        """held[0] changed: restart its clock (or stop it when idle)."""
        self.running_since = time.monotonic() if self.held and self.ready else None


class ProcessPool:
    """Worker processes that each run `handle = setup(setup_arg)` once, then `handle(task)`.

    `imap_unordered` yields results as they finish; a task whose worker died or raised,
    or that ran longer than `task_timeout` seconds (its worker is killed and replaced),
    becomes `on_failure(task, error_type, message)` instead. It may be called again once
    the previous iteration ended (one source at a time): the workers stay up in between.
    """

    def __init__(
        self,
        setup: Setup,
        setup_arg: Any,
        on_failure: Failure,
        num_workers: int,
        max_pending: int | None = None,
        start_method: str = "forkserver",
        task_timeout: float | None = None,
    ):
        if num_workers < 1:
            raise ValueError("a process pool needs at least one worker")
        self.setup = setup
        self.setup_arg = setup_arg
        self.on_failure = on_failure
        self.num_workers = num_workers
        self.max_pending = max(1, max_pending or 4 * num_workers)
        self.task_timeout = task_timeout
        self.context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            start_fork_server()
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._iterating = False

    def __enter__(self) -> ProcessPool:
        # We hold the only write end and never write: the workers watch it to outlive us by
        # at most a second (see `_next_task`).
        self._owner_alive_reader, self._owner_alive_writer = self.context.Pipe(duplex=False)
        self.workers = [self._start_worker() for _ in range(self.num_workers)]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        receive, send = self.context.Pipe(duplex=False)
        # A Queue, not a SimpleQueue: its feeder thread writes large rows without blocking us,
        # which could deadlock against a worker blocked on sending us a large result.
        tasks = self.context.Queue()
        process = self.context.Process(
            target=_worker_main,
            args=(self.setup, self.setup_arg, tasks, send, self._owner_alive_reader),
            daemon=True,
            name="vlmbatch-prep",
        )
        process.start()
        send.close()  # our copy: the pipe must report EOF once the worker is gone
        return _Worker(process, tasks, receive)

    def close(self) -> None:
        """Stop every worker; rows they still hold are dropped (the consumer stopped)."""
        for worker in self.workers:
            if worker.held:
                worker.process.kill()  # busy with rows nobody wants any more
            else:
                worker.tasks.put(None)
        for worker in self.workers:
            worker.process.join(timeout=2.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            self._release(worker)
        self.workers = []
        self._owner_alive_reader.close()
        self._owner_alive_writer.close()

    @staticmethod
    def _release(worker: _Worker) -> None:
        worker.results.close()
        worker.tasks.cancel_join_thread()  # rows still buffered for a dead worker are dropped
        worker.tasks.close()

    @property
    def in_flight(self) -> int:
        """Tasks handed to workers and not yet answered."""
        return sum(len(w.held) for w in self.workers)

    def imap_unordered(self, tasks: Iterable[Task]) -> Generator[Any, bool | None, None]:
        """Results of `tasks` in completion order, with at most `max_pending` tasks read
        from `tasks` and not yet yielded.

        `send(False)` instead of `next()` asks for a result only if one is ready, and gets
        `None` when none is: a consumer with other work (an engine with requests in flight)
        never blocks on a row. Closing it early abandons the rows still being prepared.
        """
        if self._iterating:
            raise RuntimeError("a ProcessPool serves one source at a time")
        self._iterating = True
        source = iter(tasks)
        waiting: deque[Task] = deque()  # read from the source, not yet given to a worker
        pending = 0  # read from the source, not yet yielded
        exhausted = False
        block = True
        try:
            self._top_up()
            while True:
                while not exhausted and pending < self.max_pending:
                    try:
                        waiting.append(next(source))
                    except StopIteration:
                        exhausted = True
                    else:
                        pending += 1
                self._dispatch(waiting)
                if pending == 0:
                    return
                results = self._collect(waiting, block)
                for result in results:
                    pending -= 1
                    block = (yield result) is not False
                if not results and not block:
                    block = (yield None) is not False
        finally:
            self._iterating = False
            self._abandon()

    def _top_up(self) -> None:
        """Start workers for those `_abandon` stopped."""
        while len(self.workers) < self.num_workers:
            self.workers.append(self._start_worker())

    def _abandon(self) -> None:
        """Stop the workers still holding rows of a source nobody reads any more, so their
        results cannot reach the next source; `_top_up` replaces them."""
        for worker in [w for w in self.workers if w.held]:
            worker.process.kill()
            worker.process.join()
            self._release(worker)
            self.workers.remove(worker)

    def _dispatch(self, waiting: deque[Task]) -> None:
        """Hand waiting tasks to the least busy workers, up to `_TASKS_PER_WORKER` each."""
        while waiting:
            worker = min(self.workers, key=lambda w: len(w.held))
            if len(worker.held) >= _TASKS_PER_WORKER:
                return
            task = waiting.popleft()
            worker.held.append(task)
            worker.tasks.put(task)
            if len(worker.held) == 1:
                worker.advance()

    def _collect(self, waiting: deque[Task], block: bool = True) -> list[Any]:
        """Block (or with `block=False`, only look) until some worker answers or dies;
        return the results that came in."""
        by_handle: dict[Any, _Worker] = {}
        for worker in self.workers:
            by_handle[worker.results] = worker
            by_handle[worker.process.sentinel] = worker
        results: list[Any] = []
        for handle in wait(list(by_handle), timeout=self._until_next_timeout() if block else 0):
            worker = by_handle[handle]
            if worker not in self.workers:
                continue  # already replaced through its other handle
            results.extend(self._drain(worker))
            if handle == worker.process.sentinel:
                results.extend(self._replace_dead(worker, waiting))
        for worker in list(self.workers):
            if self._overdue(worker):
                hung = worker.held[0]
                worker.process.kill()  # a hung decoder: only killing it frees the worker
                results.extend(self._drain(worker))
                results.extend(self._replace_dead(worker, waiting, hung))
        return results

    def _overdue(self, worker: _Worker) -> bool:
        started = worker.running_since
        return self.task_timeout is not None and started is not None and time.monotonic() - started > self.task_timeout

    def _until_next_timeout(self) -> float | None:
        """Seconds until the running task that started first reaches `task_timeout`."""
        starts = [w.running_since for w in self.workers if w.running_since is not None]
        if self.task_timeout is None or not starts:
            return None
        return max(0.0, min(starts) + self.task_timeout - time.monotonic())

    def _drain(self, worker: _Worker) -> list[Any]:
        """Everything the worker has sent so far (also after it died: the pipe keeps it)."""
        results = []
        while worker.results.poll():
            try:
                kind, value = pickle.loads(worker.results.recv_bytes())
            except (EOFError, OSError):  # gone, possibly in the middle of sending a result
                break
            if kind == "setup_error":
                raise PoolStartError(f"a preprocessing worker failed to start:\n{value}")
            if kind == "ready":
                worker.ready = True
            elif kind == "result":
                worker.held.popleft()
                results.append(value)
            else:
                results.append(self.on_failure(worker.held.popleft(), ErrorType.ENGINE, value))
            worker.advance()
        return results

    def _replace_dead(self, worker: _Worker, waiting: deque[Task], hung: Task | None = None) -> list[Any]:
        """Fail the row the dead worker was running (or the `hung` one we killed it for),
        requeue the rest, start a new worker."""
        worker.process.join()
        if not worker.ready:
            raise PoolStartError(f"a preprocessing worker died during start-up (exit code {worker.process.exitcode})")
        results = []
        if worker.held and hung is None:
            message = f"the preprocessing worker died on this row (exit code {worker.process.exitcode})"
            results.append(self.on_failure(worker.held.popleft(), ErrorType.WORKER_CRASH, message))
        elif worker.held and worker.held[0] is hung:  # else it finished just before the kill
            message = f"preparing this row took over {self.task_timeout:g} s"
            results.append(self.on_failure(worker.held.popleft(), ErrorType.MEDIA_TIMEOUT, message))
        waiting.extendleft(reversed(worker.held))
        self._release(worker)
        self.workers[self.workers.index(worker)] = self._start_worker()
        self.restarts += 1
        return results


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
    pixel_dtype: str | None = None
    defer_jpegs: bool = False  # JPEG bytes go to the engine for GPU decoding (engine/gpu_images.py)


def _row_preparer(adapter_spec: AdapterSpec | None) -> Callable[[Task], PreparedRow]:
    """Worker setup: the adapter is loaded now; each task is `(row_id, (preparation, raw))`,
    and the adapter and media loader are rebuilt only when a row's preparation asks for
    other ones (another model spelling or chat template; another dataset or media options)."""
    from vlmbatch.job.prepare import media_loader_for, prepare_row

    adapter = adapter_spec.load() if adapter_spec is not None else None
    media_for: tuple[str, dict[str, Any]] | None = None
    media: Any = None

    def prepare(task: Task) -> PreparedRow:
        nonlocal adapter_spec, adapter, media_for, media
        row_id, (preparation, raw) = task
        if preparation.adapter_spec != adapter_spec:
            adapter_spec = preparation.adapter_spec
            adapter = adapter_spec.load() if adapter_spec is not None else None
        if (preparation.dataset, preparation.media_io_kwargs) != media_for:
            media_for = (preparation.dataset, preparation.media_io_kwargs)
            media = media_loader_for(*media_for)
        item = prepare_row(row_id, raw, preparation.columns, preparation.defaults, adapter, media,
                           defer_jpegs=preparation.defer_jpegs)
        if item.prepared is not None and preparation.pixel_dtype is not None:
            for media_item in item.prepared.media:
                media_item.cast_pixels(preparation.pixel_dtype)  # less to pickle
        return item

    return prepare


class RowPreparer:
    """One preprocessing pool kept for the life of its owner and reused by every shard.

    A `vlmbatch worker` GPU process holds one for all the shards (of every job) it runs, and
    an in-process job one for all its shards: the workers start and load the adapter once,
    not per shard. The pool is rebuilt only after it failed to start. `starts` counts the
    pools started, `restarts` the workers replaced (crashes, timeouts, abandoned sources).
    """

    def __init__(self, num_workers: int | None = None, max_pending: int | None = None,
                 row_timeout: float | None = DEFAULT_ROW_TIMEOUT):
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        self.max_pending = max_pending
        self.row_timeout = row_timeout
        self.pool: ProcessPool | None = None
        self.starts = 0
        self._restarts_before = 0  # of pools already closed

    @property
    def restarts(self) -> int:
        return self._restarts_before + (self.pool.restarts if self.pool is not None else 0)

    def prepare(self, source: Iterable[Task], preparation: RowPreparation) -> Generator[PreparedRow | None, bool | None, None]:
        """`ProcessPool.imap_unordered` of `source` (same `send(False)` protocol)."""
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
            pool = ProcessPool(_row_preparer, adapter_spec, _failed_row, self.num_workers, self.max_pending,
                               task_timeout=self.row_timeout)
            self.pool = pool.__enter__()
            self.starts += 1

    def close(self) -> None:
        """Stop the workers (the owner is done)."""
        if self.pool is not None:
            self._restarts_before += self.pool.restarts
            self.pool.close()
            self.pool = None


def _failed_row(task: Task, error_type: str, message: str) -> PreparedRow:
    from vlmbatch.job.prepare import PreparedRow

    row_id, (_, raw) = task
    return PreparedRow(row_id=row_id, raw=raw, error=RowError(error_type, message))


def _videos_on_gpu(manifest: Any) -> bool:
    """A job whose video backend decodes on the GPU: its rows are prepared in the engine
    process, as pool workers would each open a CUDA context the engine did not budget for
    and send the frames back through the host."""
    from vlmbatch.media.video import decodes_on_gpu

    return decodes_on_gpu((manifest.media_io_kwargs or {}).get("video"))


def prepare_rows_parallel(
    source: Iterable[tuple[int, Any]],
    manifest: Any,
    adapter_spec: AdapterSpec | None,
    defaults: SamplingParams,
    num_workers: int | None = None,
    max_pending: int | None = None,
    adapter: ModelAdapter | None = None,
    row_timeout: float | None = DEFAULT_ROW_TIMEOUT,
    pixel_dtype: str | None = None,
    preparer: RowPreparer | None = None,
    defer_jpegs: bool = False,
) -> Generator[PreparedRow | None, bool | None, None]:
    """`prepare_rows` over a pool of worker processes; rows come out in completion order.

    `preparer` is the caller's long-lived pool (its size and limits apply); without one a
    pool is started for this call alone. `num_workers` defaults to `default_num_workers()`;
    0 prepares in this thread (in order) with `adapter` (the caller's loaded one) or, failing
    that, one loaded from `adapter_spec`. `max_pending` bounds the rows read from `source`
    and not yet yielded (default 4 per worker). A row still being prepared after
    `row_timeout` seconds fails with `media_timeout`. `pixel_dtype`: see `RowPreparation`.
    With workers, `send(False)` returns None instead of waiting when no row is ready.
    """
    from vlmbatch.job.prepare import prepare_rows

    if preparer is not None:
        workers = preparer.num_workers
    else:
        workers = default_num_workers() if num_workers is None else num_workers
    if _videos_on_gpu(manifest):
        workers = 0  # GPU-decoded frames stay on the engine's GPU: see docs/video.md
    if workers == 0:
        if adapter is None and adapter_spec is not None:
            adapter = adapter_spec.load()
        yield from prepare_rows(source, manifest, adapter, defaults, defer_jpegs)
        return
    preparation = RowPreparation(adapter_spec, str(manifest.dataset), manifest.media_io_kwargs or {},
                                 manifest.columns, defaults, pixel_dtype, defer_jpegs)
    if preparer is not None:
        yield from preparer.prepare(source, preparation)
        return
    own = RowPreparer(workers, max_pending, row_timeout)
    try:
        yield from own.prepare(source, preparation)
    finally:
        own.close()
