"""AsyncEngine: the background engine thread, request batching, aborts and engine failures.

A scripted engine that emits one token per step stands in for the model, so the test sees
every step boundary and which requests shared it; the HTTP tests run the real engines.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from vlmbatch.config import EngineConfig
from vlmbatch.engine.base import Engine
from vlmbatch.engine.outputs import CompletionOutput, RequestOutput
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.errors import ErrorType, RowError
from vlmbatch.families.prompt import PreparedPrompt
from vlmbatch.server.async_engine import AsyncEngine


class OneTokenPerStepEngine(Engine):
    """Appends "x" to every running request per step; a prompt token 666 makes `step()` fail,
    a prompt token 777 makes `add_request` refuse the request."""

    name = "scripted"

    def __init__(self, step_delay_s: float = 0.0):
        super().__init__(adapter=None, config=EngineConfig())  # type: ignore[arg-type]
        self.running: dict[str, tuple[PreparedPrompt, SamplingParams, list[int]]] = {}
        self.batches: list[set[str]] = []
        self.aborted: list[str] = []
        self.step_delay_s = step_delay_s

    def add_request(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams) -> None:
        if 777 in prompt.prompt_token_ids:
            raise RowError(ErrorType.PROMPT_TOO_LONG, "too long", param="messages")
        self.running[request_id] = (prompt, params, [])

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay_s)
        self.batches.append(set(self.running))
        if any(666 in p.prompt_token_ids for p, _, _ in self.running.values()):
            raise RuntimeError("kernel exploded")
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.running.items()):
            tokens.append(1)
            done = len(tokens) >= params.max_tokens
            completion = CompletionOutput(0, "x" * len(tokens), tokens, "length" if done else None)
            outputs.append(RequestOutput(request_id, None, prompt.prompt_token_ids, [completion], finished=done))
            if done:
                del self.running[request_id]
        return outputs


@pytest.fixture
def scripted() -> OneTokenPerStepEngine:
    return OneTokenPerStepEngine()


@pytest.fixture
def engine(scripted: OneTokenPerStepEngine):
    """The AsyncEngine under test, running over `scripted` (a wide burst window, so
    requests started by one `gather` reliably share their first step)."""
    running = AsyncEngine(scripted, batch_window_s=0.05)
    running.start()
    yield running
    running.stop()


async def _collect(engine: AsyncEngine, request_id: str, tokens: list[int], max_tokens: int) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, PreparedPrompt(tokens), SamplingParams(max_tokens=max_tokens))]


def test_requests_arriving_together_share_steps_and_stream_progress(scripted: OneTokenPerStepEngine, engine: AsyncEngine) -> None:
    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        return await asyncio.gather(_collect(engine, "a", [1, 2], 3), _collect(engine, "b", [3], 3))

    a, b = asyncio.run(main())
    assert [o.outputs[0].text for o in a] == ["x", "xx", "xxx"]
    assert [o.finished for o in a] == [False, False, True]
    assert b[-1].outputs[0].text == "xxx" and b[-1].prompt_token_ids == [3]
    assert scripted.batches == [{"a", "b"}] * 3
    assert engine.num_in_flight == 0


def test_a_consumer_that_goes_away_aborts_its_request(scripted: OneTokenPerStepEngine, engine: AsyncEngine) -> None:
    scripted.step_delay_s = 0.01

    async def main() -> None:
        async def read_two_then_cancel() -> None:
            async for out in engine.generate("gone", PreparedPrompt([1]), SamplingParams(max_tokens=10_000)):
                if len(out.outputs[0].token_ids) == 2:
                    await asyncio.sleep(10)  # a client that stopped reading; cancelled below

        task = asyncio.create_task(read_two_then_cancel())
        while engine.num_in_flight == 0 or not scripted.batches:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if engine.num_in_flight == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert scripted.aborted == ["gone"]
    assert not scripted.has_unfinished_requests()
    assert engine.num_in_flight == 0
    assert len(scripted.batches) < 1000


def test_engine_failures_reach_their_requests_and_the_loop_keeps_serving(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(RowError) as refused:
            await _collect(engine, "refused", [777], 2)
        assert refused.value.error_type == ErrorType.PROMPT_TOO_LONG
        with pytest.raises(RowError) as crashed:
            await _collect(engine, "crash", [666], 2)
        assert crashed.value.error_type == ErrorType.ENGINE and "kernel exploded" in crashed.value.message
        after = await _collect(engine, "after", [1], 2)
        assert after[-1].outputs[0].text == "xx"

    asyncio.run(main())
    assert engine.num_in_flight == 0


def test_stop_fails_requests_still_running(scripted: OneTokenPerStepEngine, engine: AsyncEngine) -> None:
    scripted.step_delay_s = 0.01

    async def main() -> None:
        task = asyncio.create_task(_collect(engine, "long", [1], 10_000))
        while engine.num_in_flight == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.stop)
        with pytest.raises(RowError, match="shutting down"):
            await task

    asyncio.run(main())


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(engine: AsyncEngine) -> None:
    from vlmbatch.server.completions import ChatCompletions, PreparedRequest
    from vlmbatch.server.settings import ServerSettings

    completions = ChatCompletions(adapter=None, engine=engine, media=None, settings=ServerSettings(model="m"))  # type: ignore[arg-type]
    request = PreparedRequest("chatcmpl-1", PreparedPrompt([666]), SamplingParams(max_tokens=4))

    async def main() -> list[str]:
        return [event async for event in completions.stream(request, include_usage=True, created=0)]

    events = asyncio.run(main())
    completions.close()
    assert '"role":"assistant"' in events[0]
    assert '"code":"engine_error"' in events[1] and "kernel exploded" in events[1]
    assert events[2:] == ["data: [DONE]\n\n"]
