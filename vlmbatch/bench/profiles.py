"""Where a step's time goes: the costliest ops of the vision tower and of decode steps."""

from __future__ import annotations

import time
from typing import Any

import torch

from vlmbatch.bench import adapt
from vlmbatch.bench.timing import sync
from vlmbatch.bench.workloads import build_workload
from vlmbatch.engine.sampling_params import SamplingParams


def _costliest(prof, device: torch.device, top: int) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls) of a profile's costliest ops: device time on a GPU, CPU
    time elsewhere."""
    cost = (lambda e: e.device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if cost(e) > 0), key=cost, reverse=True)
    return [(e.key[:90], cost(e), e.count) for e in events[:top]]


def profile_vision(engine, images: int = 56, top: int = 10) -> dict[str, Any]:
    """Wall time of the vision tower on `images` fresh W1 images in one batch (what one
    prefill step of W1 encodes) and its costliest ops: the tower dominated W1 once."""
    from torch.profiler import ProfilerActivity, profile

    prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, images, seed=20_000), engine.adapter, engine.runner.dtype)
    adapt.encode_images(engine, prompts[:2])  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        adapt.encode_images(engine, prompts[2:])
        sync(engine.device)
    seconds = time.perf_counter() - start
    return {"images": images - 2, "ms": 1000 * seconds,
            "ops": [{"op": name, "ms": us / 1000, "calls": calls} for name, us, calls in _costliest(prof, engine.device, top)]}


def profile_decode(engine, batch: int, steps: int = 8, top: int = 12) -> list[dict[str, Any]]:
    """The GPU kernels of `steps` decode steps at `batch` sequences, the costliest first
    (CUDA-graph replays included): what to fuse or tune next."""
    from torch.profiler import ProfilerActivity, profile

    batch = min(batch, engine.scheduler.max_num_seqs)
    workload = build_workload("w1", engine.adapter, batch, seed=10_000 + batch)
    for i, prompt in enumerate(adapt.engine_prompts(workload, engine.adapter, engine.runner.dtype)):
        engine.add_request(f"profile-{i}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    while engine.stats.num_decode_steps == 0 or engine.scheduler.waiting:
        engine.step()
    engine.step()
    on_gpu = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return [{"kernel": name, "us_per_step": us / steps, "calls_per_step": calls / steps} for name, us, calls in _costliest(prof, engine.device, top)]
