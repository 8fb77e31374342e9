"""A crash-isolating process pool: tasks out of order, bounded, surviving dead workers.

Each worker runs `handle = setup(setup_arg)` once, then `handle(task)` for every task it
is given; results come back as soon as they are ready, out of order (a task carries its
id). What it promises, each covered by tests/test_pool.py and tests/test_pool_reuse.py:
- bounded memory: at most `max_pending` tasks are between the source and the consumer, and
  the source iterator is only advanced when there is room (a slow consumer slows reading);
- a worker that dies (decoder segfault, `os._exit`, OOM kill) fails only the task it was
  working on, as `ErrorType.WORKER_CRASH`; a task that runs past `task_timeout` fails as
  `ErrorType.MEDIA_TIMEOUT` and its worker is killed; either way the tasks queued behind it
  go to other workers and the worker is replaced;
- closing the iterator (cancel, early `break`, garbage collection) stops the workers, and
  so does killing the process that owns the pool, by any signal (`kill -9` too);
- a pool outlives one source: `imap_unordered` may be called again once the previous
  iteration ended, with the same workers. A source closed early kills the workers still
  holding its tasks (their results can never reach the next source) and they are
  restarted when the next one starts.

Each worker has its own task queue (at most `_TASKS_PER_WORKER` tasks deep) and its own
result pipe, which is what lets the parent know exactly which task a dead worker held; a
shared queue (`concurrent.futures.ProcessPoolExecutor`) loses that and breaks the whole pool
on one crash. Results travel as pickles through the pipe, not as torch shared memory
(container `/dev/shm` is often 64 MiB, which a few hundred rows of pixel tensors overflow),
with tensors pickled as raw bytes: torch's own pickling goes through `torch.save` and costs
~10x more (4.7 MB of pixel_values: ~25 ms vs ~2 ms of CPU per round trip here).
"""
from __future__ import annotations

import io
import multiprocessing
import pickle
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from vlmbatch.errors import ErrorType
from vlmbatch.lifeline import set_parent_death_signal, watch_pipe

# One task being handled plus one waiting, so a worker never idles between tasks while a
# slow one (a long video) holds back at most one other.
_TASKS_PER_WORKER = 2

Task = tuple[int, Any]  # (row_id, payload)
Setup = Callable[[Any], Callable[[Task], Any]]  # setup(arg) -> handle(task) -> result
Failure = Callable[[Task, str, str], Any]  # on_failure(task, error_type, message) -> result


class PoolStartError(RuntimeError):
    """A worker failed before handling any task (its setup raised or it died): a job problem."""


class _TensorPickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes (any dtype, bf16 included)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # not imported: nothing here is a tensor
        if torch is not None and isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
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


def start_fork_server(preload: Sequence[str] = ()) -> None:
    """Start this process's fork server now, importing `preload` once (seconds for torch and
    transformers), e.g. while a model loads: pools started later fork their workers from it
    in ~0.5 s with those modules already imported. Only the first call's `preload` counts."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    forkserver.ensure_running()


def _worker_main(setup: Setup, setup_arg: Any, tasks: Any, results: Connection, owner_alive: Connection) -> None:
    """Build the handler once, then answer tasks until the `None` sentinel.

    First, the lifeline: a killed owner (`kill -9` of a job worker) cannot stop its pool.
    The worker's parent is the fork server (or the owner itself with another start method):
    the parent-death signal covers its death; the owner holds the only write end of
    `owner_alive` and never writes, so EOF there means the owner died, also while this
    worker is busy with a long row (`vlmbatch.lifeline`)."""
    set_parent_death_signal()
    watch_pipe(owner_alive)
    try:
        handle = setup(setup_arg)
    except BaseException:  # noqa: BLE001 - any setup failure must reach the parent, not vanish
        results.send_bytes(_dumps(("setup_error", traceback.format_exc())))
        return
    results.send_bytes(_dumps(("ready", None)))
    while (task := tasks.get()) is not None:
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
        preload: Sequence[str] = (),
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
            start_fork_server(preload)
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._iterating = False

    def __enter__(self) -> ProcessPool:
        # We hold the only write end and never write: the workers watch it so as never to
        # outlive us (see `_worker_main`).
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
