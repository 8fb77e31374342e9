"""`vlmbatch bench kernels`: check the Triton kernels and time them on the GPU.

One run (a few minutes on an H200) checks every kernel against its reference in bf16 and
fp16, measures the machine's ceilings (device copy bandwidth, a bf16 8192^3 matmul), then
times decode and prefill attention over the shapes the engine serves, with torch SDPA on
the same data as the peer. Timings are `triton.testing.do_bench` medians (L2 flushed).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from vlmbatch.bench.fp8 import bench_fp8_linear, best_fp8_rows
from vlmbatch.bench.roofline import measure_ceilings
from vlmbatch.kernels.decode_attention import DecodeConfig, choose_num_splits, paged_decode_attention, sm_count
from vlmbatch.kernels.kv_cache_write import store_kvcache
from vlmbatch.kernels.prefill_attention import TUNED_TABLE_PATH as PREFILL_TUNED_PATH
from vlmbatch.kernels.prefill_attention import PrefillConfig, paged_prefill_attention
from vlmbatch.kernels.reference import (
    apply_rotary_ref,
    gather_paged_kv,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    store_kvcache_ref,
)
from vlmbatch.kernels.norm import rms_norm
from vlmbatch.kernels.rotary import apply_rotary
from vlmbatch.kernels.skinny_gemm import SkinnyConfig, skinny_linear
from vlmbatch.kernels.testing import TOLERANCE, PagedKV, make_paged_kv

HEAD_DIM = 128
MODELS = {"3B": (16, 2), "7B": (28, 4)}  # (query heads, KV heads) of Qwen2.5-VL
DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXTS = (1024, 4096)
SPLIT_SWEEP = (1, 2, 4, 8, 16)
PAGE_SWEEP = (16, 64, 256)
SWEEP_PAGE = 128
DECODE_CONFIGS = tuple(
    DecodeConfig(block_n, warps, stages)
    for block_n, warps, stages in (
        (32, 4, 2), (32, 4, 4), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3),
    )
)  # fmt: skip
PREFILL_CONFIGS = (
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(128, 64, 4, 3),
    PrefillConfig(128, 32, 4, 3),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 64, 4, 2),
    PrefillConfig(64, 32, 4, 2),
)
PREFILL_BATCH, PREFILL_LEN = 64, 512
# The launch-table sweep: full prefill steps (the engine's 16,384-token budget) of prompts
# this long, 7B heads (Qwen2-7B: LLaVA-OneVision/NeXT, InternVL3-8B, Qwen2.5-VL-7B), the
# engine's GPU page size.
PREFILL_STEP_TOKENS = 16384
PREFILL_SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096)
PREFILL_SWEEP_PAGE = 256
# (name, out_features, in_features) of each decoder linear layer (q/k/v and gate/up fused).
LINEAR_SHAPES = {
    "3B": (("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 22016, 2048), ("down", 2048, 11008), ("lm_head", 151936, 2048)),
    "7B": (("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944), ("lm_head", 152064, 3584)),
}
LINEAR_ROWS = (1, 16, 64)
LINEAR_BYTES_PER_GRAPH = 768 << 20  # weights cycled through per timed graph: far past the 50 MB L2
SKINNY_CONFIGS = tuple(
    SkinnyConfig(block_n, block_k, warps, stages)
    for block_n in (16, 32, 64) for block_k in (128, 256, 512) for warps, stages in ((4, 3), (4, 5), (8, 4))
)  # fmt: skip


@dataclass
class BenchReport:
    """Everything one run measured; `ok` is False when any kernel disagreed with its reference."""

    device: str
    ceilings: dict[str, float] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    prefill_lengths: list[dict] = field(default_factory=list)
    linear: list[dict] = field(default_factory=list)
    fp8: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check["ok"] for check in self.checks)


def median_ms(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def kernel_ceilings(device: torch.device) -> dict[str, float]:
    """What the hardware gives to plain PyTorch (`roofline.measure_ceilings`), in the units of
    the kernel tables: the yardsticks for the kernels' numbers."""
    ceilings = measure_ceilings(device)
    return {"copy_tb_s": ceilings["copy_bytes_per_s"] / 1e12, "matmul_bf16_tflop_s": ceilings["matmul_flops_per_s"] / 1e12}


def compare(kernel: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Max abs / rel error of a kernel output against its reference, judged by TOLERANCE."""
    atol, rtol = TOLERANCE[dtype]
    diff = (actual.float() - expected.float()).abs()
    has_nan = bool(actual.isnan().any())
    within = bool((diff <= atol + rtol * expected.float().abs()).all())
    return {
        "kernel": kernel,
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs": float(diff.max()),
        "max_rel": float((diff / (expected.float().abs() + atol)).max()),
        "nan": has_nan,
        "ok": within and not has_nan,
    }


def check_kernels(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Each kernel on fresh random inputs with the awkward cases (ragged, prefix-cached, q_len 1)."""
    num_q_heads, num_kv_heads = MODELS["3B"]
    scale = HEAD_DIM**-0.5
    context_lens = [1, 127, 128, 300, 1000, 2049]
    kv = make_paged_kv(context_lens, num_kv_heads, HEAD_DIM, 128, dtype, device, seed=11)
    generator = torch.Generator(device=device).manual_seed(12)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    checks = []
    q = randn(len(context_lens), num_q_heads, HEAD_DIM)
    decode_args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    decode_ref = paged_decode_attention_ref(*decode_args)
    for num_splits in (None, 4):
        name = f"decode splits={num_splits or 'auto'}"
        checks.append(compare(name, dtype, paged_decode_attention(*decode_args, num_splits=num_splits), decode_ref))

    q_lens = [1, 127, 128, 50, 1000, 2049]  # q_len < context_len: prefix-cache hits / chunks
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = randn(sum(q_lens), num_q_heads, HEAD_DIM)
    prefill = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, max(q_lens), scale
    )
    ref = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, scale)
    checks.append(compare("prefill", dtype, prefill, ref))

    k_new, v_new = randn(64, num_kv_heads, HEAD_DIM), randn(64, num_kv_heads, HEAD_DIM)
    slots = torch.randperm(kv.k_cache.shape[0] * 128, device=device)[:64]
    slots[::7] = -1
    expected_k, expected_v = kv.k_cache.clone(), kv.v_cache.clone()
    store_kvcache_ref(k_new, v_new, expected_k, expected_v, slots)
    store_kvcache(k_new, v_new, kv.k_cache, kv.v_cache, slots)
    checks.append(compare("store_kvcache k", dtype, kv.k_cache, expected_k))
    checks.append(compare("store_kvcache v", dtype, kv.v_cache, expected_v))

    x, residual, weight = randn(300, 2048), randn(300, 2048), randn(2048)
    checks.append(compare("rms_norm", dtype, rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)))
    fused, ref_fused = rms_norm(x, weight, 1e-6, residual), rms_norm_ref(x, weight, 1e-6, residual)
    checks.append(compare("rms_norm+residual", dtype, fused[0], ref_fused[0]))
    checks.append(compare("rms_norm residual out", dtype, fused[1], ref_fused[1]))

    angles = torch.randn(300, HEAD_DIM, generator=generator, device=device) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_rot, k_rot = randn(300, num_q_heads, HEAD_DIM), randn(300, num_kv_heads, HEAD_DIM)
    for name, actual, expected in zip(("rotary q", "rotary k"), apply_rotary(q_rot, k_rot, cos, sin),
                                      apply_rotary_ref(q_rot, k_rot, cos, sin)):  # fmt: skip
        checks.append(compare(name, dtype, actual, expected))
    return checks


def gathered_kv(kv: PagedKV, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same KV made contiguous `[batch, kv_heads, context, head_dim]`: SDPA's best case."""
    context_len = int(kv.context_lens[0])
    k = torch.stack([gather_paged_kv(kv.k_cache, kv.block_tables[b], context_len) for b in range(batch)])
    v = torch.stack([gather_paged_kv(kv.v_cache, kv.block_tables[b], context_len) for b in range(batch)])
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class DecodeShape:
    model: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * self.num_kv_heads * HEAD_DIM * torch.bfloat16.itemsize


def bench_decode(device: torch.device, copy_tb_s: float, sweep_configs: bool = True) -> list[dict]:
    """Decode over every model x batch x context: split and page sweeps, SDPA peer, config sweep on the headline."""
    rows = []
    for model, (num_q_heads, num_kv_heads) in MODELS.items():
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                shape = DecodeShape(model, batch, context, num_q_heads, num_kv_heads)
                headline = sweep_configs and (model, batch, context) == ("3B", 256, 1024)
                rows += bench_decode_shape(shape, device, copy_tb_s, DECODE_CONFIGS if headline else ())
    return rows


def bench_decode_shape(
    shape: DecodeShape, device: torch.device, copy_tb_s: float, configs: tuple[DecodeConfig, ...]
) -> list[dict]:
    """One shape: the automatic split at every page size; at SWEEP_PAGE each split count, `configs`, and SDPA."""
    rows = []
    q = torch.randn(shape.batch, shape.num_q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def add(page: int, variant: str, fn: Callable[[], object]) -> None:
        ms = median_ms(fn)
        tb_s = shape.kv_bytes / ms / 1e9
        rows.append({**shape.__dict__, "page": page, "variant": variant, "ms": ms, "kv_tb_s": tb_s,
                     "pct_of_copy": 100 * tb_s / copy_tb_s})  # fmt: skip

    for page in (SWEEP_PAGE, *PAGE_SWEEP):
        kv = make_paged_kv([shape.context] * shape.batch, shape.num_kv_heads, HEAD_DIM, page, torch.bfloat16, device)
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, HEAD_DIM**-0.5)
        max_context = kv.block_tables.shape[1] * page
        auto = choose_num_splits(shape.batch, shape.num_kv_heads, max_context, sm_count(device), DecodeConfig().block_n)
        add(page, f"triton splits=auto({auto})", lambda: paged_decode_attention(*args))
        if page != SWEEP_PAGE:
            continue
        for splits in SPLIT_SWEEP:
            add(page, f"triton splits={splits}", lambda: paged_decode_attention(*args, num_splits=splits))
        for config in configs:
            add(page, f"triton {config}", lambda: paged_decode_attention(*args, config=config))
        k, v = gathered_kv(kv, shape.batch)
        q4 = q.unsqueeze(2)
        add(page, "torch SDPA (gathered contiguous)", lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    return rows


def bench_prefill(device: torch.device, matmul_tflop_s: float) -> list[dict]:
    """64 x 512 causal prompts (and the same queries after a 512-token cached prefix) vs SDPA."""
    rows = []
    dtype = torch.bfloat16
    num_q_heads, num_kv_heads = MODELS["3B"]
    scale = HEAD_DIM**-0.5
    q = torch.randn(PREFILL_BATCH * PREFILL_LEN, num_q_heads, HEAD_DIM, device=device, dtype=dtype)
    cu = torch.arange(0, PREFILL_BATCH + 1, dtype=torch.int32, device=device) * PREFILL_LEN

    def row(prefix: int, page: int, variant: str, ms: float) -> dict:
        # Causal work: each query sees prefix + its own position + 1 keys; QK^T and PV 2 flops each.
        keys_seen = PREFILL_BATCH * (PREFILL_LEN * prefix + PREFILL_LEN * (PREFILL_LEN + 1) / 2)
        tflop_s = 4 * keys_seen * num_q_heads * HEAD_DIM / ms / 1e9
        return {
            "prefix": prefix, "page": page, "variant": variant, "ms": ms, "tflop_s": tflop_s,
            "pct_of_matmul": 100 * tflop_s / matmul_tflop_s,
        }  # fmt: skip

    for prefix in (0, PREFILL_LEN):
        for page in (128, 256):
            kv = make_paged_kv([prefix + PREFILL_LEN] * PREFILL_BATCH, num_kv_heads, HEAD_DIM, page, dtype, device)
            args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, PREFILL_LEN, scale)
            for config in PREFILL_CONFIGS if (prefix, page) == (0, 128) else (PrefillConfig(),):
                ms = median_ms(lambda: paged_prefill_attention(*args, config=config))
                rows.append(row(prefix, page, f"triton {config}", ms))
            if prefix == 0 and page == 128:
                q4 = q.view(PREFILL_BATCH, PREFILL_LEN, num_q_heads, HEAD_DIM).transpose(1, 2)
                k, v = gathered_kv(kv, PREFILL_BATCH)
                ms = median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True))
                rows.append(row(prefix, page, "torch SDPA (contiguous, causal)", ms))
                del k, v
    return rows


def bench_prefill_lengths(device: torch.device, matmul_tflop_s: float) -> list[dict]:
    """Every launch config on full prefill steps of PREFILL_SWEEP_LENGTHS-token prompts (7B
    heads, page 256), and SDPA on the same prompts padded into one batch; the launch table
    (`write_prefill_table`) takes the fastest config of each length."""
    rows = []
    num_q_heads, num_kv_heads = MODELS["7B"]
    scale = HEAD_DIM**-0.5
    for length in PREFILL_SWEEP_LENGTHS:
        batch = PREFILL_STEP_TOKENS // length
        q = torch.randn(batch * length, num_q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * length
        kv = make_paged_kv([length] * batch, num_kv_heads, HEAD_DIM, PREFILL_SWEEP_PAGE, torch.bfloat16, device)
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, length, scale)
        flop = 4 * batch * length * (length + 1) / 2 * num_q_heads * HEAD_DIM

        def add(variant: str, fn: Callable[[], object], config: PrefillConfig | None = None) -> None:
            try:
                ms = median_ms(fn)
            except OutOfResources:
                return
            rows.append({"length": length, "batch": batch, "variant": variant, "config": config, "ms": ms,
                         "tflop_s": flop / ms / 1e9, "pct_of_matmul": 100 * flop / ms / 1e9 / matmul_tflop_s})  # fmt: skip

        for config in PREFILL_CONFIGS:
            add(f"triton {config}", lambda: paged_prefill_attention(*args, config=config), config)
        q4 = q.view(batch, length, num_q_heads, HEAD_DIM).transpose(1, 2)
        k, v = gathered_kv(kv, batch)
        add("torch SDPA (contiguous, causal)", lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True))
        del q, q4, k, v, kv
    return rows


def write_prefill_table(rows: list[dict], device: str, path: Path | str = PREFILL_TUNED_PATH) -> Path:
    """The fastest triton config of each swept length into the prefill launch table."""
    best: dict[int, dict] = {}
    for row in rows:
        if row["config"] is not None and (row["length"] not in best or row["ms"] < best[row["length"]]["ms"]):
            best[row["length"]] = row
    table = {
        "measured": f"{device}, bfloat16, {time.strftime('%Y-%m-%d')}: full {PREFILL_STEP_TOKENS}-token causal steps of prompts "
                    f"of each length, {MODELS['7B'][0]}/{MODELS['7B'][1]} heads of dim {HEAD_DIM}, page {PREFILL_SWEEP_PAGE}",
        "configs": {str(length): {**asdict(row["config"]), "ms": round(row["ms"], 3), "tflop_s": round(row["tflop_s"], 1)}
                    for length, row in sorted(best.items())},
    }  # fmt: skip
    path = Path(path)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def graph_ms_per_call(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Milliseconds per call of `fn` over `weights` in turn, captured in one CUDA graph as
    the engine's decode steps are (no launch gaps; each weight is read from memory)."""
    fn(weights[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return median_ms(graph.replay) / len(weights)


def bench_linear(device: torch.device, copy_tb_s: float, sweep_configs: bool = True) -> list[dict]:
    """Decode-step linear layers: cuBLAS (`F.linear`) against `skinny_linear` (every config
    of SKINNY_CONFIGS when sweeping, the default otherwise); weight_tb_s = weight bytes / time."""
    rows = []
    for model, shapes in LINEAR_SHAPES.items():
        for name, n, k in shapes:
            nbytes = n * k * torch.bfloat16.itemsize
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(max(1, LINEAR_BYTES_PER_GRAPH // nbytes))]
            for num_rows in LINEAR_ROWS:
                x = torch.randn(num_rows, k, device=device, dtype=torch.bfloat16)
                expected = F.linear(x, weights[0])

                def add(variant: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
                    try:
                        out = fn(weights[0])
                    except OutOfResources:  # a config whose tiles do not fit in shared memory
                        return
                    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                    ms = graph_ms_per_call(fn, weights)
                    tb_s = nbytes / ms / 1e9
                    rows.append({"model": model, "layer": name, "n": n, "k": k, "rows": num_rows, "variant": variant,
                                 "us": 1000 * ms, "weight_tb_s": tb_s, "pct_of_copy": 100 * tb_s / copy_tb_s, "rel_err": error})  # fmt: skip

                add("cublas F.linear", lambda w: F.linear(x, w))
                for config in SKINNY_CONFIGS if sweep_configs else (SkinnyConfig(),):
                    add(f"skinny {config}", lambda w, c=config: skinny_linear(x, w, None, c))
            del weights
    return rows


def best_linear_rows(rows: list[dict]) -> list[dict]:
    """Per (model, layer, rows): cuBLAS and the fastest skinny config."""
    best: dict[tuple, dict] = {}
    out = []
    for row in rows:
        key = (row["model"], row["layer"], row["rows"])
        if row["variant"].startswith("cublas"):
            out.append(row)
        elif key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    return out + list(best.values())


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width text table (the device has no rich)."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "" if value is None else str(value)


def run_kernel_bench(
    json_path: Path | None, sweep_configs: bool = True, echo: Callable[[str], None] = print,
    sections: tuple[str, ...] = ("prefill", "decode", "linear"), write_table: bool = False,
) -> BenchReport:
    """Check, then time; print the tables and write them to `json_path` when given;
    `write_table`: the prefill sweep's winners into the kernel's launch table."""
    device = torch.device("cuda")
    report = BenchReport(device=torch.cuda.get_device_name(device))
    started = time.perf_counter()

    def section(title: str, rows: list[dict], columns: list[str]) -> None:
        """Print a finished section and save everything so far (a run cut short keeps it)."""
        echo(f"\n== {title} ({time.perf_counter() - started:.0f} s into the run)\n" + format_table(rows, columns))
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({**report.__dict__, "ok": report.ok}, indent=1, default=str))

    for dtype in (torch.bfloat16, torch.float16):
        report.checks += check_kernels(device, dtype)
    section("kernels vs references", report.checks, ["kernel", "dtype", "max_abs", "max_rel", "nan", "ok"])
    if not report.ok:
        echo("FAILED: a kernel disagrees with its reference (see above); timings follow anyway")
    report.ceilings = kernel_ceilings(device)
    echo(f"\nceilings: {report.ceilings}")
    if "prefill" in sections:
        report.prefill = bench_prefill(device, report.ceilings["matmul_bf16_tflop_s"])
        section(f"prefill (bf16, {PREFILL_BATCH} x {PREFILL_LEN} causal, 3B heads)", report.prefill,
                ["prefix", "page", "variant", "ms", "tflop_s", "pct_of_matmul"])  # fmt: skip
        report.prefill_lengths = bench_prefill_lengths(device, report.ceilings["matmul_bf16_tflop_s"])
        section(f"prefill by prompt length (bf16, {PREFILL_STEP_TOKENS}-token causal steps, 7B heads, page {PREFILL_SWEEP_PAGE})",
                report.prefill_lengths, ["length", "batch", "variant", "ms", "tflop_s", "pct_of_matmul"])  # fmt: skip
        if write_table:
            echo(f"wrote {write_prefill_table(report.prefill_lengths, report.device)}")
    if "decode" in sections:
        report.decode = bench_decode(device, report.ceilings["copy_tb_s"], sweep_configs)
        section("decode (bf16; kv_tb_s = K and V bytes read / time)", report.decode,
                ["model", "batch", "context", "page", "variant", "ms", "kv_tb_s", "pct_of_copy"])  # fmt: skip
    if "linear" in sections:
        report.linear = bench_linear(device, report.ceilings["copy_tb_s"], sweep_configs)
        section("decode linear layers (bf16; weight_tb_s = weight bytes / time; cuBLAS and the best skinny config)",
                best_linear_rows(report.linear), ["model", "layer", "rows", "variant", "us", "weight_tb_s", "pct_of_copy", "rel_err"])  # fmt: skip
    if "fp8" in sections:
        report.fp8 = bench_fp8_linear(device, report.ceilings["copy_tb_s"], LINEAR_SHAPES, graph_ms_per_call, LINEAR_BYTES_PER_GRAPH)
        section("fp8 linear layers (quantization of the input included; weight_tb_s = weight bytes / time)",
                report.fp8, ["model", "layer", "rows", "variant", "us", "weight_tb_s", "pct_of_copy", "rel_err", "error"])  # fmt: skip
        section("fp8 per layer: bf16, what Fp8Linear runs (plan) and the fastest of each layout (vs_bf16 < 1: FP8 faster)",
                best_fp8_rows(report.fp8), ["model", "layer", "rows", "variant", "us", "bf16_us", "vs_bf16"])  # fmt: skip
    if json_path is not None:
        echo(f"\nwrote {json_path}")
    return report
