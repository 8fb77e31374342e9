"""The decode-step roofline: a step's bytes (weights + KV read) and FLOPs against ceilings
measured on the same device (a device-to-device copy and a large bf16 matmul)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from vlmbatch.bench import adapt
from vlmbatch.bench.timing import run_engine, sync
from vlmbatch.bench.workloads import build_workload


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on `device`
    (fp32 and small on the CPU, where bf16 matmuls crawl: its figures are for smoke runs);
    on GPUs with e4m3 tensor cores (SM 8.9+) also the FP8 rate, `torch._scaled_mm` with
    per-row and per-column scales as our FP8 layers call it (`fp8_matmul_flops_per_s`)."""

    def timed(fn: Callable[[], Any], repeats: int = 20) -> float:
        fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(device)
        return (time.perf_counter() - start) / repeats

    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, dtype=dtype, device=device)
    matmul_s = timed(lambda: a @ a, repeats=10)
    ceilings = {"copy_bytes_per_s": 2 * src.numel() / copy_s, "matmul_flops_per_s": 2 * n**3 / matmul_s}
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        rows, columns = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
        fp8_s = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=rows, scale_b=columns, out_dtype=torch.bfloat16), repeats=10)
        ceilings["fp8_matmul_flops_per_s"] = 2 * n**3 / fp8_s
    return ceilings


def decode_step_cost(decoder, batch: int, context: int, kv_itemsize: int | None = None) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `batch` sequences with `context` cached tokens:
    every dense weight but the embedding table is read once, at its own element size (1
    byte for FP8 weights, plus their scales); of a mixture-of-experts layer
    only the experts the batch routes to, as many as `batch` uniform top-k draws are expected
    to hit (E * (1 - (1 - k/E)^batch)); each sequence reads its KV."""
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    from vlmbatch.engine.layers.moe import FusedMoE

    itemsize = decoder.embed_tokens.weight.dtype.itemsize
    experts = [m for m in decoder.modules() if isinstance(m, FusedMoE)]
    expert_params = {id(p) for m in experts for p in (m.gate_up, m.down)}
    dense = [p for name, p in decoder.named_parameters() if not name.startswith("embed_tokens") and id(p) not in expert_params]
    fp8 = [m for m in decoder.modules() if isinstance(m, Fp8Linear)]  # 1-byte weight buffers, float32 scales
    nbytes = sum(p.numel() for p in dense) * itemsize + sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in fp8)
    flops = 2 * batch * (sum(p.numel() for p in dense) + sum(m.weight.numel() for m in fp8))
    for moe in experts:
        count, top_k = moe.gate_up.shape[0], moe.top_k
        per_expert = moe.gate_up[0].numel() + moe.down[0].numel()
        nbytes += count * (1 - (1 - top_k / count) ** batch) * per_expert * moe.gate_up.element_size()  # 1 byte: FP8 experts
        flops += 2 * batch * top_k * per_expert
    layers, kv_heads, head_dim = len(decoder.layers), decoder.num_kv_heads, decoder.head_dim
    q_heads = decoder.layers[0].self_attn.num_heads
    nbytes += batch * context * layers * 2 * kv_heads * head_dim * (kv_itemsize or itemsize)  # an FP8 cache: 1 byte
    flops += batch * layers * 4 * context * q_heads * head_dim
    return nbytes, flops


def fp8_flops_per_token(decoder) -> float:
    """FLOPs per token of the decoder's FP8 products: its `Fp8Linear` projections and, of
    an FP8 mixture of experts, the top-k experts."""
    from vlmbatch.engine.layers.fp8_linear import Fp8Linear
    from vlmbatch.engine.layers.moe import FusedMoE

    flops = 2 * sum(m.weight.numel() for m in decoder.modules() if isinstance(m, Fp8Linear))
    for moe in (m for m in decoder.modules() if isinstance(m, FusedMoE) and m.fp8_scales):
        flops += 2 * moe.top_k * (moe.gate_up[0].numel() + moe.down[0].numel())
    return flops


def matmul_seconds(flops: float, fp8_flops: float, ceilings: dict[str, float]) -> float:
    """`flops` of products at the measured rates: `fp8_flops` of them at the FP8 one."""
    seconds = (flops - fp8_flops) / ceilings["matmul_flops_per_s"]
    return seconds + fp8_flops / ceilings["fp8_matmul_flops_per_s"] if fp8_flops else seconds


def decode_roofline(engine, batch: int, ceilings: dict[str, float], steps: int = 32) -> dict[str, float]:
    """Measured decode-step time at `batch` W1 sequences (at most the engine's max_num_seqs)
    vs the time the ceilings allow."""
    batch = min(batch, engine.scheduler.max_num_seqs)
    workload = build_workload("w1", engine.adapter, batch, seed=batch)
    result = run_engine(engine, adapt.engine_prompts(workload, engine.adapter, engine.runner.dtype), [steps] * batch, f"decode-b{batch}")
    context = workload.prompt_tokens + steps // 2
    decoder = adapt.decoder(engine)
    nbytes, flops = decode_step_cost(decoder, batch, context, engine.runner.kv_dtype.itemsize)
    bound_s = max(nbytes / ceilings["copy_bytes_per_s"], matmul_seconds(flops, batch * fp8_flops_per_token(decoder), ceilings))
    measured_s = result.decode_step_ms / 1000
    steps_run = max(1, result.extra["num_decode_steps"])
    return {"batch": batch, "context": context, "decode_step_ms": result.decode_step_ms, "roofline_ms": 1000 * bound_s,
            "pct_of_roofline": 100 * bound_s / measured_s, "bytes": nbytes, "flops": flops,
            "launch_ms": 1000 * result.extra["decode_launch_s"] / steps_run, "wait_ms": 1000 * result.extra["decode_wait_s"] / steps_run}
