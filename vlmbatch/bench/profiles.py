"""Where a step's time goes: the costliest ops of the vision tower, of a full prefill step and of decode steps."""

from __future__ import annotations

import time
from collections.abc import Callable
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
    """The encode of `images` fresh W1 images in one batch (what one prefill step of W1
    encodes): its wall time from host pixels, split into the pixels' upload and the encode
    of pixels already on the device (the tower and what the engine does around it: in a
    W1 of Qwen3-VL-8B the vision phase took 2.3 ms an image against the tower's 1.8 in
    `bench tower`), then one profiled encode's costliest ops."""
    from torch.profiler import ProfilerActivity, profile

    prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, images, seed=20_000), engine.adapter, engine.runner.dtype)
    adapt.encode_images(engine, prompts[:2])  # warm-up
    timed = prompts[2:]

    def wall_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
        adapt.clear_encoder_cache(engine)  # every encode runs the tower
        sync(engine.device)
        start = time.perf_counter()
        result = fn()
        sync(engine.device)
        return 1000 * (time.perf_counter() - start), result

    from_host, _ = wall_ms(lambda: adapt.encode_images(engine, timed))
    upload, resident = wall_ms(lambda: adapt.with_pixels_on(timed, engine.device))
    on_device, _ = wall_ms(lambda: adapt.encode_images(engine, resident))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    adapt.clear_encoder_cache(engine)
    with profile(activities=activities) as prof:
        adapt.encode_images(engine, timed)
        sync(engine.device)
    return {"images": len(timed), "ms": from_host, "upload_ms": upload, "on_device_ms": on_device,
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


def profile_prefill(engine, top: int = 14) -> dict[str, Any]:
    """Wall time and costliest kernels of one full prefill step: as many fresh W1 prompts as
    fill the step's token budget, their images encoded first (untimed), so the step is the
    language model alone. An 8B W1 spends over half its time in such steps, at ~64% of the
    matmul peak: this says where the rest goes. Kernels launched with programmatic dependent
    launch overlap their predecessor, so their times add up to more than the step's."""
    from torch.profiler import ProfilerActivity, profile

    prompt_tokens = build_workload("w1", engine.adapter, 1, seed=30_000).prompt_tokens
    count = max(1, min(engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens // prompt_tokens))
    prompts = adapt.engine_prompts(build_workload("w1", engine.adapter, 2 * count, seed=30_000), engine.adapter, engine.runner.dtype)
    adapt.encode_images(engine, prompts[count:])  # the timed step's media, so that step finds them cached
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def one_step(batch: list, tag: str) -> float:
        for i, prompt in enumerate(batch):
            engine.add_request(f"prefill-{tag}-{i}", prompt, params)
        sync(engine.device)
        start = time.perf_counter()
        engine.step()
        sync(engine.device)
        seconds = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return seconds

    one_step(prompts[:count], "warm")
    on_gpu = engine.device.type == "cuda"
    hits = engine.model.num_encoder_cache_hits
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        seconds = one_step(prompts[count:], "timed")
    return {"prompts": count, "tokens": count * prompt_tokens, "ms": 1000 * seconds,
            "encoder_cache_hits": engine.model.num_encoder_cache_hits - hits,
            "kernels": [{"kernel": name, "ms": us / 1000, "calls": calls} for name, us, calls in _costliest(prof, engine.device, top)]}
