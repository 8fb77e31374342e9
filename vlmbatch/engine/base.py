"""The contract every generation engine implements (`hf` reference, `paged` fast engine).

Engines are step-driven, like vLLM's `LLMEngine`: the batch runner, the Python API and
the server add requests, call `step()` until nothing is unfinished, and read the
outputs each step returns. A static-batch engine may return everything in one step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from vlmbatch.config import EngineConfig
from vlmbatch.engine.outputs import RequestOutput
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.families.prompt import PreparedPrompt


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is right now, for metrics (read from another thread at scrape time:
    plain counts, no device work)."""

    running: int  # sequences being generated
    waiting: int  # sequences queued for admission
    kv_cache_usage: float  # share of the KV-cache blocks in use, 0..1


class Engine(ABC):
    name: str
    # True: `step()` returns every request that progressed, with its text so far (the
    # server streams them). False (batch work): only finished requests, which spares a
    # per-step output object and incremental detokenisation for every running sequence.
    stream_outputs: bool = False
    # Whether rows may hand this engine JPEG bytes to decode on its GPU (`gpu_images`).
    decodes_images_on_gpu: bool = False

    def __init__(self, adapter: ModelAdapter, config: EngineConfig):
        self.adapter = adapter
        self.config = config

    @abstractmethod
    def add_request(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams) -> None:
        """Queue a request; generation starts on a later `step()`."""

    @abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Drop a request (a disconnected client, a cancelled job); no output is returned for it."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Advance generation; return the requests that finished (and, with `stream_outputs`,
        those that progressed). Each output holds the text and token ids so far; `finished`
        says whether the request is done."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    def load(self) -> EngineLoad | None:
        """Running and waiting sequences and KV-cache use; None for an engine without a
        scheduler or a paged KV cache (the `hf` reference)."""
        return None
