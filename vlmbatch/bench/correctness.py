"""Our engine's numbers checked before they are timed: logits per attention backend against
`transformers` fp32 on the same weights, and asynchronous decoding against awaited steps."""

from __future__ import annotations

import copy
import gc
import random
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from vlmbatch.bench import adapt
from vlmbatch.bench.peers.hf import reference_logits
from vlmbatch.bench.roofline import decode_roofline
from vlmbatch.bench.workloads import Workload, build_workload
from vlmbatch.engine.sampling_params import SamplingParams


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def relative_errors(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    """Per-position ||ours - ref|| / ||ref|| (max and mean) and top-1 agreement."""
    rel = torch.cat([(o - r).norm(dim=-1) / r.norm(dim=-1) for o, r in zip(ours, reference)])
    agree = torch.cat([(o.argmax(-1) == r.argmax(-1)).float() for o, r in zip(ours, reference)])
    return {"max_rel_err": rel.max().item(), "mean_rel_err": rel.mean().item(), "top1_agreement": agree.mean().item()}


@dataclass
class LogitReference:
    """Prompts, forced continuations, `transformers` fp32 logits for them, and the error bound."""

    workload: Workload
    continuations: list[list[int]]
    logits: list[torch.Tensor]
    bound: float
    transformers_low_precision: dict[str, float] | None


def logit_reference(hf_model, adapter, prompts: int, decode_steps: int, device: torch.device,
                    min_bound: float | None = None) -> LogitReference:
    """Reference logits from an fp32 copy of `hf_model` on `prompts` W1 requests. When
    `hf_model` itself is in a lower precision, its own error against fp32 sets the bound:
    ours may be off by at most twice what `transformers` loses (and 2e-2 at least); in fp32
    the bound is 1e-4. `min_bound` raises the floor (FP8: `bench.fp8.FP8_MIN_BOUND`)."""
    workload = build_workload("w1", adapter, prompts, seed=7)
    rng = random.Random(1)
    continuations = [[rng.randrange(100, len(adapter.tokenizer)) for _ in range(decode_steps)] for _ in range(prompts)]
    low_precision = hf_model.dtype != torch.float32
    fp32 = copy.deepcopy(hf_model).float() if low_precision else hf_model
    logits = reference_logits(fp32, adapter, workload, continuations, device)
    del fp32
    free_memory(device)
    hf_errors = relative_errors(reference_logits(hf_model, adapter, workload, continuations, device), logits) if low_precision else None
    bound = max(2 * hf_errors["max_rel_err"], 2e-2) if hf_errors else 1e-4
    bound = max(bound, min_bound or 0.0)
    return LogitReference(workload, continuations, logits, bound, hf_errors)


def check_backends(engine, reference: LogitReference, backends: list[str], ceilings: dict[str, float]) -> dict[str, Any]:
    """Our teacher-forced logits with each attention backend against the reference, and each
    backend's decode step at batch 64; the engine goes back to its own backend afterwards."""
    report: dict[str, Any] = {"positions_per_prompt": len(reference.continuations[0]) + 1,
                              "prompts": len(reference.continuations), "bound_max_rel_err": reference.bound,
                              "transformers_low_precision": reference.transformers_low_precision, "backends": {}}
    prompts = adapt.engine_prompts(reference.workload, engine.adapter, engine.runner.dtype)
    configured = engine.runner.backend.name
    for name in backends:
        try:
            adapt.use_attention_backend(engine, name)
            engine.block_manager.reset_prefix_cache()
            errors = relative_errors(adapt.teacher_forced_logits(engine, prompts, reference.continuations), reference.logits)
            speed = decode_roofline(engine, 64, ceilings, steps=16)
            report["backends"][name] = dict(errors, ok=errors["max_rel_err"] <= reference.bound, decode_step_ms_b64=speed["decode_step_ms"])
        except Exception as exc:  # noqa: BLE001  (a backend that fails to run is a finding, not the end)
            report["backends"][name] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-4000:]}
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
    adapt.use_attention_backend(engine, configured)
    passing = [b for b, e in report["backends"].items() if e["ok"]]
    report["fastest_backend"] = min(passing, key=lambda b: report["backends"][b]["decode_step_ms_b64"]) if passing else None
    report["timed_backend"] = configured
    return report


def check_async_decoding(engine, tokens: int = 24) -> dict[str, Any]:
    """Greedy tokens with decode steps launched on the previous step's samples still on the
    device against the same prompts with every step awaited, run twice to show how far two
    awaited runs agree on this device. The requests are prefilled in one step and run the
    same length, so every run steps identical batches and the tokens must be equal bit for
    bit. (With staggered finishes they need not be: a sequence that ended at step n still
    fills its row in step n + 1, so the last steps' batches differ, and in bf16 a different
    batch can flip a near-tie. The CPU tests cover staggered finishes and aborts in fp32.)"""
    scheduler = engine.scheduler
    workload = build_workload("w1", engine.adapter, 64, seed=30_000)
    requests = min(64, scheduler.max_num_seqs, scheduler.max_num_batched_tokens // workload.prompt_tokens)
    prompts = adapt.engine_prompts(workload.head(requests), engine.adapter, engine.runner.dtype)
    runs, configured = [], engine.async_decode
    for async_decode in (False, False, True):
        engine.async_decode = async_decode
        engine.block_manager.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"async-check-{len(runs)}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({int(o.request_id.rsplit("-", 1)[1]): o.outputs[0].token_ids for o in engine.step() if o.finished})
        runs.append([finished.get(i) for i in range(requests)])
    engine.async_decode = configured

    def agreement(a: list, b: list) -> tuple[int, list[dict]]:
        differing = [{"request": i, "position": next((k for k, (x, y) in enumerate(zip(p, q)) if x != y), None)}
                     for i, (p, q) in enumerate(zip(a, b)) if p != q]
        return requests - len(differing), differing

    equal, differing = agreement(runs[0], runs[2])
    repeat_equal, repeat_differing = agreement(runs[0], runs[1])
    return {"requests": requests, "tokens": tokens, "equal": equal, "differing": differing,
            "awaited_repeat_equal": repeat_equal, "awaited_repeat_differing": repeat_differing,
            "ok": equal == requests and None not in runs[2]}
