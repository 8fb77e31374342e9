"""The `transformers` peer: `generate()` on static batches (image workloads, and V1's videos), and the fp32 reference logits.

A static batch runs to its longest request; only each request's own tokens count as
output. Each timed batch size is first warmed up with one full untimed batch of that
size and the same forced lengths (the batch with the longest output), so allocator
growth and kernel selection are not charged to the rate: timed after a 2-request warm-up
instead, one cold batch of 128 gave 9.09 req/s on W1 against 21.6 warmed (issue 13).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import torch

from vlmbatch.bench.timing import RunResult, sync
from vlmbatch.bench.workloads import Workload
from vlmbatch.media.types import VideoFrames


def hf_inputs(adapter, workload: Workload, indices: list[int], model: torch.nn.Module, device: torch.device,
              continuation: list[int] | None = None) -> dict[str, torch.Tensor]:
    """One static batch of the workload's requests `indices`, through the model's own HF
    processor (prompts of one workload have one length: no padding), pixels in the model's
    dtype; `continuation` appends tokens to every prompt (teacher-forced references)."""
    processed = adapter.processor(text=[workload.requests[i].prompt for i in indices],
                                  images=[workload.images(i) for i in indices], return_tensors="pt")  # per prompt: SmolVLM needs it
    inputs = dict(processed)
    if continuation:
        extra = torch.tensor([list(continuation)] * len(indices), dtype=inputs["input_ids"].dtype)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return forward_inputs(adapter, inputs, model, device)


def hf_video_inputs(adapter, prompts: list[str], videos: list[VideoFrames], model: torch.nn.Module,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """One static batch of raw prompts with one sampled video each, through the model's own
    processor with our adapter's video arguments (the frames as sampled, their metadata):
    the inputs our engine's prompts are made of."""
    processed = adapter.processor(text=list(prompts), **adapter._video_inputs(list(videos)), return_tensors="pt")
    return forward_inputs(adapter, dict(processed), model, device)


def forward_inputs(adapter, inputs: dict[str, torch.Tensor], model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The processor's outputs that the model's forward takes, on `device`, pixels in its dtype."""
    accepted = inspect.signature(model.forward).parameters
    for key in ("mm_token_type_ids", "token_type_ids"):  # rebuilt from the ids: older processors do not return
        if key in accepted:  # them, and a continuation lengthens the ids (Gemma 3: token_type_ids)
            inputs[key] = adapter.mm_token_type_ids(inputs["input_ids"])
    inputs = {k: v for k, v in inputs.items() if k in accepted}
    for key, value in inputs.items():
        if key.startswith("pixel_values") and value.is_floating_point():
            inputs[key] = value.to(model.dtype)
    return {k: v.to(device) for k, v in inputs.items()}


@torch.no_grad()
def reference_logits(model: torch.nn.Module, adapter, workload: Workload, continuations: list[list[int]],
                     device: torch.device) -> list[torch.Tensor]:
    """`transformers` logits of each prompt's last token and of each continuation token (one
    forward over prompt + continuation), fp32 on the host."""
    out = []
    for index, continuation in enumerate(continuations):
        logits = model(**hf_inputs(adapter, workload, [index], model, device, continuation)).logits[0]
        out.append(logits[workload.prompt_tokens - 1 :].float().cpu())
    return out


@torch.no_grad()
def run_hf_peer(model: torch.nn.Module, adapter, workload: Workload, batch_size: int, device: torch.device,
                echo: Callable[[str], None] = print) -> RunResult:
    """`generate()` over static batches of `batch_size`, after one untimed full batch of that
    size; only the `generate()` calls are timed (their inputs are made before each)."""
    lengths = [r.output_tokens for r in workload.requests]
    return _timed_batches(model, lambda batch: hf_inputs(adapter, workload, batch, model, device), lengths, batch_size,
                          device, workload.name, workload.output_tokens, echo)


@torch.no_grad()
def run_hf_video_peer(model: torch.nn.Module, adapter, prompts: list[str], videos: list[VideoFrames], output_tokens: int,
                      batch_size: int, device: torch.device, echo: Callable[[str], None] = print) -> RunResult:
    """`generate()` on raw prompts with one sampled video each (V1), `output_tokens` forced:
    static batches of `batch_size` after one untimed full batch; inputs made before each call."""
    def inputs(batch: list[int]) -> dict[str, torch.Tensor]:
        return hf_video_inputs(adapter, [prompts[i] for i in batch], [videos[i] for i in batch], model, device)

    return _timed_batches(model, inputs, [output_tokens] * len(prompts), batch_size, device, "v1", output_tokens * len(prompts), echo)


def _timed_batches(model: torch.nn.Module, make_inputs: Callable[[list[int]], dict[str, torch.Tensor]], lengths: list[int],
                   batch_size: int, device: torch.device, workload: str, output_tokens: int,
                   echo: Callable[[str], None]) -> RunResult:
    """The warm-up batch (the longest full one), then every batch, each run to its longest request."""
    count = len(lengths)
    batches = [list(range(at, min(at + batch_size, count))) for at in range(0, count, batch_size)]

    def longest(batch: list[int]) -> int:
        return max(lengths[i] for i in batch)

    def generate(batch: list[int]) -> float:
        inputs = make_inputs(batch)
        tokens = longest(batch)
        sync(device)
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        sync(device)
        return time.perf_counter() - start

    warmup = max(batches, key=lambda b: (len(b), longest(b)))
    warmup_s = generate(warmup)
    echo(f"hf-generate-b{batch_size} {workload}: warmed up on {len(warmup)} requests ({warmup_s:.1f} s), "
         f"timing {count} in {len(batches)} batches")
    seconds = sum(generate(batch) for batch in batches)
    return RunResult(f"hf-generate-b{batch_size}", workload, count, seconds, output_tokens,
                     extra={"batch_size": batch_size, "batches": len(batches), "warmup_requests": len(warmup),
                            "warmup_s": warmup_s})
