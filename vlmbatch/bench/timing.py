"""A timed run of our engine: every request queued at once, stepped to the end."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.families.prompt import PreparedPrompt


@dataclass
class RunResult:
    """One engine's run of one workload (ours: "paged"; peers: "hf-generate-b<batch>", "vllm")."""

    engine: str
    workload: str
    requests: int
    seconds: float
    output_tokens: int
    decode_step_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), requests_per_s=self.requests_per_s, output_tokens_per_s=self.output_tokens_per_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(engine) -> dict[str, Any]:
    """`EngineStats` and the structured-output mask counters (prefixed `mask_`)."""
    return {**asdict(engine.stats), **{f"mask_{k}": v for k, v in asdict(engine.structured.stats).items()}}


@contextlib.contextmanager
def triton_compiles() -> Iterator[Counter]:
    """Counts the Triton kernels this process compiles (or loads from the disk cache) inside
    the block, by name: a timed pass that compiles pays for it in its figure, and a first pass
    slower than the second is explained or ruled out by these counts. Empty where this Triton
    has no compile hooks."""
    compiled: Counter = Counter()
    try:
        from triton import knobs
    except ImportError:
        yield compiled
        return

    def count(*, fn, **_: Any) -> None:
        compiled[fn.name.rsplit(".", 1)[-1]] += 1  # returns None: the compile goes ahead

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = count
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous


def run_engine(engine, prompts: list[PreparedPrompt], lengths: list[int], workload: str, structured_output: Any = None) -> RunResult:
    """All requests queued at once (their queueing counted), stepped to the end; the
    decode-step time is the median wall time of decode steps (each ends in a host copy of
    the sampled tokens, so it is synced). `extra` holds this run's share of `EngineStats`
    and the Triton kernels compiled during it (`triton_compiles`, by name).
    `structured_output` (a `StructuredOutput`) constrains every request."""
    stats_before = _stats(engine)
    engine.time_phases = True
    with triton_compiles() as compiled:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(f"{workload}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                                         structured_output=structured_output))
        queued_s = time.perf_counter() - start
        decode_times = []
        while engine.has_unfinished_requests():
            was_decode = engine.stats.num_decode_steps
            step_start = time.perf_counter()
            engine.step()
            if engine.stats.num_decode_steps > was_decode:
                decode_times.append(time.perf_counter() - step_start)
        seconds = time.perf_counter() - start
    stats = {k: v - stats_before[k] for k, v in _stats(engine).items()}
    stats["add_request_s"] = queued_s
    stats["triton_compiles"] = dict(compiled)
    return RunResult("paged", workload, len(prompts), seconds, stats["num_generated_tokens"],
                     1000 * statistics.median(decode_times) if decode_times else None, stats)
