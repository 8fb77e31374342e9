"""Share one blocking, step-driven `Engine` between many asyncio requests.

Engine calls are blocking torch work, so they all run in ONE background thread that
owns the engine; the event loop never touches it. The two sides talk through a
thread-safe command queue (add / abort) one way and per-request `asyncio.Queue`s fed
with `loop.call_soon_threadsafe` the other way. Requests that arrive while the engine
is busy wait in the command queue and join the next `step()` together, and an idle
engine waits a few milliseconds after the first arrival so a burst lands in one batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vlmbatch.engine.base import Engine
from vlmbatch.engine.outputs import CompletionOutput, RequestOutput
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.prompt import PreparedPrompt
from vlmbatch.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: PreparedPrompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine thread keeps mutating its own."""
    return RequestOutput(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
        outputs=[
            CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason, o.error,
                             None if o.logprobs is None else list(o.logprobs))
            for o in output.outputs
        ],
        finished=output.finished,
    )


class AsyncEngine:
    """Runs `engine` in a background thread; `generate()` streams one request's progress."""

    def __init__(self, engine: Engine, batch_window_s: float = 0.005, metrics: ServerMetrics | None = None):
        self._engine = engine
        self._metrics = metrics
        engine.stream_outputs = True
        self._batch_window_s = batch_window_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}  # written only by the engine thread
        self._thread: threading.Thread | None = None

    @property
    def num_in_flight(self) -> int:
        """Requests the engine thread holds (added and neither finished nor aborted); a request
        leaves before its last output is delivered, so a caller that saw it end sees it gone."""
        return len(self._streams)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vlmbatch-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(_Stop())
            self._thread.join(timeout)
            self._thread = None

    async def generate(
        self, request_id: str, prompt: PreparedPrompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress until it finishes.

        Leaving early (the consumer stops, or its task is cancelled because the client
        disconnected) aborts the request in the engine, so nobody computes for a ghost.
        """
        outputs: asyncio.Queue = asyncio.Queue()
        timer = self._metrics.timer() if self._metrics is not None else None
        self._commands.put(_Add(request_id, prompt, params, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped it
                    raise item
                finished = item.finished
                if timer is not None:
                    generated = [len(o.token_ids) for o in item.outputs]
                    timer.progressed(max(generated, default=0))
                    if finished:
                        timer.finished(len(item.prompt_token_ids or ()), sum(generated))
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    # ---- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        running = True
        while running:
            if self._engine.has_unfinished_requests():
                running = self._drain(window_s=0.0)
            else:  # idle: sleep until work arrives, then let a burst gather
                running = self._apply(self._commands.get()) and self._drain(self._batch_window_s)
            if running and self._engine.has_unfinished_requests():
                self._step()

    def _drain(self, window_s: float) -> bool:
        """Apply the queued commands, waiting up to `window_s` for more; False once asked to stop."""
        deadline = time.monotonic() + window_s
        while True:
            try:
                command = self._commands.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: object) -> bool:
        if isinstance(command, _Stop):
            self._fail_all(RowError(ErrorType.ENGINE, "the server is shutting down"))
            return False
        if isinstance(command, _Add):
            try:
                self._engine.add_request(command.request_id, command.prompt, command.params)
            except RowError as error:
                self._deliver(command, error)
                return True
            except Exception as error:  # noqa: BLE001 - the engine refused this request alone
                logger.exception("engine rejected request %s", command.request_id)
                self._deliver(command, RowError(ErrorType.ENGINE, f"engine error: {error}"))
                return True
            self._streams[command.request_id] = command
        elif isinstance(command, _Abort) and self._streams.pop(command.request_id, None) is not None:
            try:
                self._engine.abort_request(command.request_id)
            except Exception:  # noqa: BLE001 - the request is dropped from our side regardless
                logger.exception("engine failed to abort request %s", command.request_id)
        return True

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            logger.exception("engine step failed")
            self._fail_all(RowError(ErrorType.ENGINE, f"engine error: {error}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if output.finished:
                del self._streams[output.request_id]
            self._deliver(stream, _snapshot(output))

    def _fail_all(self, error: RowError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self._engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - already gone inside a broken engine
                logger.debug("abort of %s after an engine failure also failed", request_id)
            self._deliver(stream, error)

    @staticmethod
    def _deliver(stream: _Add, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass
