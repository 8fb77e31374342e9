"""The floor of a workload on this GPU: the least time any engine could take for it.

Every matmul of the run at the measured bf16 matmul rate (an FP8 one at the measured FP8
rate: the decoder's FP8 projections and experts, a tower's `torch._scaled_mm` products),
plus the KV cache the decode steps must read at the measured copy bandwidth, and nothing
else costing time (no host work, no elementwise passes, no launch gaps). The matmuls are
the decoder's linear layers for every prompt token and every decoded token (a mixture of
experts: the top-k experts per token), the LM head for every sampled token, causal
attention over each prompt and each decoded token's context (a sliding layer attends to,
and reads, its window only), and the vision tower's FLOPs per request as
`FlopCounterMode` counts one encode of the workload's own media (on a GPU that includes
SDPA; on the CPU it does not). With the floor, a requests/s figure becomes a share of what
the hardware allows, and a goal such as "1.5x vLLM" a share it asks for (BENCHMARKS.md
session 13: 83-88% on short-prompt W1, beyond 100% on the long anyres prompts of
LLaVA-NeXT and OneVision).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmbatch.bench import adapt
from vlmbatch.bench.roofline import decode_step_cost, fp8_flops_per_token, matmul_seconds
from vlmbatch.bench.workloads import Workload

VISION_SAMPLE = 4  # requests whose media one counted encode covers


def vision_flops_per_request(engine, workload: Workload, dtype: torch.dtype) -> tuple[float, float]:
    """FLOPs of the vision tower per request, and how many of them are FP8 products (a tower
    in FP8 runs its large products through `torch._scaled_mm`), from one encode of the first
    requests' media."""
    from torch.utils.flop_counter import FlopCounterMode

    prompts = adapt.engine_prompts(workload.head(VISION_SAMPLE), engine.adapter, dtype)
    if not any(p.media for p in prompts):
        return 0.0, 0.0
    adapt.clear_encoder_cache(engine)  # counted only if the tower runs
    counter = FlopCounterMode(display=False)
    with counter:
        adapt.encode_images(engine, prompts)
    fp8 = counter.get_flop_counts().get("Global", {}).get(torch.ops.aten._scaled_mm, 0)
    return counter.get_total_flops() / len(prompts), fp8 / len(prompts)


def workload_floor(engine, workload: Workload, ceilings: dict[str, float], vision_per_request: tuple[float, float]) -> dict[str, Any]:
    """The floor of `workload` on the engine's model: its FLOPs (and how many of them are
    FP8) and KV bytes by part, the seconds they take at `ceilings` and the most requests/s
    that allows. `vision_per_request`: the tower's FLOPs per request, and its FP8 ones."""
    decoder = adapt.decoder(engine)
    _, per_token = decode_step_cost(decoder, batch=1, context=0)  # linear layers (top-k experts) and, untied, the LM head
    lm_head = 2 * decoder.lm_head.weight.numel()
    tied = decoder.lm_head.weight is decoder.embed_tokens.weight  # then `decode_step_cost` left it out with the embedding
    linear = per_token - (0 if tied else lm_head)
    kv_per_token, _ = (a - b for a, b in zip(decode_step_cost(decoder, 1, 1, engine.runner.kv_dtype.itemsize),
                                             decode_step_cost(decoder, 1, 0, engine.runner.kv_dtype.itemsize)))
    windows = [layer.self_attn.window for layer in decoder.layers]
    q_width = decoder.layers[0].self_attn.num_heads * decoder.head_dim

    def attention(first: int, last: int) -> float:
        """FLOPs (QK and PV, every layer) of the tokens whose contexts are first..last tokens long."""
        return sum(4 * q_width * _context_sum(first, last, window) for window in windows)

    prompt = workload.prompt_tokens
    vision, vision_fp8 = vision_per_request
    parts = {"linear": 0.0, "lm_head": 0.0, "attention": 0.0, "vision": vision * len(workload.requests)}
    fp8_flops, fp8_per_token = vision_fp8 * len(workload.requests), fp8_flops_per_token(decoder)
    kv_bytes = 0.0
    for request in workload.requests:
        decoded = request.output_tokens - 1  # the first output token comes from the prompt's last position
        parts["linear"] += linear * (prompt + decoded)
        fp8_flops += fp8_per_token * (prompt + decoded)
        parts["lm_head"] += lm_head * request.output_tokens
        parts["attention"] += attention(1, prompt) + attention(prompt + 1, prompt + decoded)
        kv_bytes += kv_per_token / len(windows) * sum(_context_sum(prompt + 1, prompt + decoded, window) for window in windows)
    flops = sum(parts.values())
    seconds = matmul_seconds(flops, fp8_flops, ceilings) + kv_bytes / ceilings["copy_bytes_per_s"]
    return {"requests": len(workload.requests), "flops": flops, "fp8_flops": fp8_flops, "flops_by_part": parts,
            "kv_read_bytes": kv_bytes, "seconds": seconds, "max_requests_per_s": len(workload.requests) / seconds}


def _context_sum(first: int, last: int, window: int) -> int:
    """The sum of min(c, window) (window 0: c) over c = first..last; 0 when last < first."""
    if last < first:
        return 0
    if not window or last <= window:
        return (first + last) * (last - first + 1) // 2
    below = _context_sum(first, window, 0) if first <= window else 0
    return below + window * (last - max(first, window + 1) + 1)


def floor_lines(floors: dict[str, dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """One line per workload: the floor, and ours / vLLM as shares of it, with what 1.5x vLLM asks."""
    lines = []
    for name, floor in floors.items():
        rates = summary.get(name, {})
        share = {engine: rates.get(f"{engine}_requests_per_s") and rates[f"{engine}_requests_per_s"] / floor["max_requests_per_s"]
                 for engine in ("paged", "vllm")}  # fmt: skip
        shares = ", ".join(f"{'ours' if e == 'paged' else e} {100 * s:.0f}%" for e, s in share.items() if s)
        ask = f"; 1.5x vLLM asks {150 * share['vllm']:.0f}%" if share["vllm"] else ""
        fp8 = f" ({floor['fp8_flops'] / 1e15:.2f} of them FP8)" if floor["fp8_flops"] else ""
        lines.append(f"  {name} floor: {floor['flops'] / 1e15:.2f} PFLOP{fp8} + {floor['kv_read_bytes'] / 1e12:.2f} TB of KV reads = "
                     f"{floor['seconds']:.2f} s at the measured ceilings (at most {floor['max_requests_per_s']:.1f} req/s)"
                     + (f": {shares} of it{ask}" if shares else ""))
    return lines
