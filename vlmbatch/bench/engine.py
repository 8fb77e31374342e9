"""`vlmbatch bench engine`: the paged engine against the `generate()` peer, and against
`transformers` fp32 logits, on real model shapes with random weights.

Workloads (Qwen2.5-VL shapes): W1 = N requests, one 448x448 image each (256 image
tokens) in a 288-token prompt, exactly 128 output tokens; W2 = W1 with output lengths
uniform in 16..512. The peer runs static batches through `generate()` (a batch lasts as
long as its longest request). The roofline of a decode step is computed from its bytes
(weights + KV read) and FLOPs against ceilings measured on the same device (a
device-to-device copy and a large bf16 matmul).
"""

from __future__ import annotations

import copy
import gc
import inspect
import random
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlmbatch.bench.adapt import teacher_forced_logits
from vlmbatch.engine.sampling_params import SamplingParams
from vlmbatch.models.base import PreparedPrompt

# Published Qwen2.5-VL configs (text and vision sizes only; no download needed);
# "tiny" keeps the test checkpoint's sizes (CPU smoke runs of this module).
_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
               temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
_TEXT = dict(max_position_embeddings=128000, rms_norm_eps=1e-6)
SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"text": {}, "vision": {}},
    "3b": {
        "text": dict(_TEXT, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                     intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
        "vision": dict(_VISION, out_hidden_size=2048),
    },
    "7b": {
        "text": dict(_TEXT, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
        "vision": dict(_VISION, out_hidden_size=3584),
    },
}
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
IMAGE_TOKENS, PROMPT_TOKENS, W1_OUTPUT, W2_RANGE = 256, 288, 128, (16, 512)


# ---- models ---------------------------------------------------------------------------
def random_model(shape: str, workdir: Path, dtype: torch.dtype, device: torch.device):
    """(adapter, HF model with random weights) of a Qwen2.5-VL size, built in memory.

    The tiny checkpoint supplies tokenizer, processor and special-token ids; its config
    is rewritten with the real sizes so the adapter sees the real context length."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmbatch.models.registry import load_adapter
    from vlmbatch.testing.tiny import make_tiny_model

    path = make_tiny_model(workdir / f"qwen2_5_vl-{shape}", "qwen2_5_vl")
    config = AutoConfig.from_pretrained(path)
    if SHAPES[shape]["text"]:
        for key, value in SHAPES[shape]["text"].items():
            setattr(config.text_config, key, value)
        config.text_config.rope_parameters = dict(ROPE)
        for key, value in SHAPES[shape]["vision"].items():
            setattr(config.vision_config, key, value)
        config.tie_word_embeddings = SHAPES[shape]["text"]["tie_word_embeddings"]
        if getattr(config.text_config, "layer_types", None) is not None:  # derived at init: follow the new depth
            config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
        config.save_pretrained(path)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return load_adapter(str(path)), model.eval()


def real_model(path: str, dtype: torch.dtype, device: torch.device):
    """(adapter, HF model) of a real Qwen-VL checkpoint: the workloads are Qwen image prompts."""
    from vlmbatch.models.registry import load_adapter, load_hf_model

    adapter = load_adapter(path)
    if adapter.family not in ("qwen2_5_vl", "qwen2_vl"):
        raise ValueError(f"the engine benchmark's workloads need a Qwen2-VL/Qwen2.5-VL model, not {adapter.family}")
    return adapter, load_hf_model(path, dtype, str(device))


# ---- workloads ------------------------------------------------------------------------
def w1_prompts(adapter, count: int, seed: int = 0, pixel_dtype: torch.dtype = torch.float32) -> list[PreparedPrompt]:
    """`count` 288-token prompts, each with its own 448x448 image (256 tokens after the merge).

    Pixels are random and shared (content does not change the cost); each request gets
    its own content hash, so nothing is served from the encoder or prefix caches. Jobs'
    preprocessing pools deliver pixels in the engine's dtype (`pixel_dtype`): what the
    tower computes in, and half the bytes of float32 to copy to the GPU."""
    config = adapter.config
    rng = random.Random(seed)
    specials = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    words = [t for t in range(100, len(adapter.tokenizer)) if t not in specials and t not in adapter.eos_token_ids]
    side = int(IMAGE_TOKENS**0.5) * 2  # patches per side before the 2x2 merge
    patch = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    pixels = torch.randn(side * side, patch).to(pixel_dtype)
    grid = torch.tensor([[1, side, side]])
    text = PROMPT_TOKENS - IMAGE_TOKENS - 2
    prompts = []
    for i in range(count):
        before = [rng.choice(words) for _ in range(text // 4)]
        after = [rng.choice(words) for _ in range(text - len(before))]
        ids = before + [config.vision_start_token_id] + [config.image_token_id] * IMAGE_TOKENS + [config.vision_end_token_id] + after
        prompts.append(PreparedPrompt(ids, {"pixel_values": pixels, "image_grid_thw": grid}, mm_hashes=[f"bench-{seed}-{i}"]))
    return prompts


def output_lengths(workload: str, count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [W1_OUTPUT] * count if workload == "w1" else [rng.randint(*W2_RANGE) for _ in range(count)]


@dataclass
class RunResult:
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine, prompts: list[PreparedPrompt], lengths: list[int], workload: str) -> RunResult:
    """All requests queued at once (their preparation counted), stepped to the end;
    decode-step time is the median wall time of decode steps (each ends in a host copy
    of the sampled tokens, so it is synced)."""
    stats_before = asdict(engine.stats)
    engine.time_phases = True
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"{workload}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    queued_s = time.perf_counter() - start
    decode_times = []
    while engine.has_unfinished_requests():
        was_decode = engine.stats.num_decode_steps
        step_start = time.perf_counter()
        engine.step()
        if engine.stats.num_decode_steps > was_decode:
            decode_times.append(time.perf_counter() - step_start)
    generated = engine.stats.num_generated_tokens - stats_before["num_generated_tokens"]
    seconds = time.perf_counter() - start
    stats = {k: v - stats_before[k] for k, v in asdict(engine.stats).items()}  # this run's share of the counters
    stats["add_request_s"] = queued_s
    return RunResult("paged", workload, len(prompts), seconds, generated,
                     1000 * statistics.median(decode_times) if decode_times else None, stats)


def hf_inputs(adapter, prompts: list[PreparedPrompt], device: torch.device, hf_model) -> dict[str, torch.Tensor]:
    """One static batch; W1/W2 prompts all have the same length, so no padding is needed.
    `mm_token_type_ids` only goes to transformers versions whose forward takes it."""
    ids = torch.tensor([p.prompt_token_ids for p in prompts])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in inspect.signature(hf_model.forward).parameters:
        inputs["mm_token_type_ids"] = adapter.mm_token_type_ids(ids)
    for key in prompts[0].mm_inputs:
        inputs[key] = torch.cat([p.mm_inputs[key] for p in prompts])
    return {k: v.to(device) for k, v in inputs.items()}


@torch.no_grad()
def run_peer(hf_model, adapter, prompts: list[PreparedPrompt], lengths: list[int], batch_size: int, workload: str, device: torch.device) -> RunResult:
    """`generate()` over static batches; each batch runs to its longest request, and only
    each request's own tokens count as output. One short untimed batch first, so start-up
    (kernel selection, allocator growth) is not charged to the rate."""
    hf_model.generate(**hf_inputs(adapter, prompts[:2], device, hf_model), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    for at in range(0, len(prompts), batch_size):
        longest = max(lengths[at : at + batch_size])
        hf_model.generate(**hf_inputs(adapter, prompts[at : at + batch_size], device, hf_model),
                          max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
    _sync(device)
    return RunResult(f"hf-generate-b{batch_size}", workload, len(prompts), time.perf_counter() - start, sum(lengths))


# ---- correctness ----------------------------------------------------------------------
@torch.no_grad()
def reference_logits(hf_model, adapter, prompts: list[PreparedPrompt], continuations: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """`transformers` logits of each prompt's last token and of each continuation token
    (one forward over prompt + continuation), fp32 on the host."""
    out = []
    for prompt, continuation in zip(prompts, continuations):
        full = PreparedPrompt(prompt.prompt_token_ids + list(continuation), prompt.mm_inputs)
        logits = hf_model(**hf_inputs(adapter, [full], device, hf_model)).logits[0]
        out.append(logits[prompt.num_tokens - 1 :].float().cpu())
    return out


def relative_errors(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    """Per-position ||ours - ref|| / ||ref|| (max and mean) and top-1 agreement."""
    rel = torch.cat([(o - r).norm(dim=-1) / r.norm(dim=-1) for o, r in zip(ours, reference)])
    agree = torch.cat([(o.argmax(-1) == r.argmax(-1)).float() for o, r in zip(ours, reference)])
    return {"max_rel_err": rel.max().item(), "mean_rel_err": rel.mean().item(), "top1_agreement": agree.mean().item()}


@dataclass
class LogitReference:
    """Forced continuations, `transformers` fp32 logits for them, and the error bound."""

    prompts: list[PreparedPrompt]
    continuations: list[list[int]]
    logits: list[torch.Tensor]
    bound: float
    transformers_low_precision: dict[str, float] | None


def logit_reference(hf_model, adapter, prompts: list[PreparedPrompt], decode_steps: int, device: torch.device) -> LogitReference:
    """Reference logits from an fp32 copy of `hf_model`. When `hf_model` itself is in a
    lower precision, its own error against fp32 sets the bound: ours may be off by at
    most twice what `transformers` loses (and 2e-2 at least); in fp32 the bound is 1e-4."""
    rng = random.Random(1)
    continuations = [[rng.randrange(100, len(adapter.tokenizer)) for _ in range(decode_steps)] for _ in prompts]
    low_precision = hf_model.dtype != torch.float32
    fp32 = copy.deepcopy(hf_model).float() if low_precision else hf_model
    logits = reference_logits(fp32, adapter, prompts, continuations, device)
    del fp32
    _free(device)
    hf_errors = relative_errors(reference_logits(hf_model, adapter, prompts, continuations, device), logits) if low_precision else None
    bound = max(2 * hf_errors["max_rel_err"], 2e-2) if hf_errors else 1e-4
    return LogitReference(prompts, continuations, logits, bound, hf_errors)


def check_backends(engine, reference: LogitReference, backends: list[str], adapter, ceilings: dict[str, float]) -> dict[str, Any]:
    """Our teacher-forced logits with each attention backend against the reference, and
    each backend's decode step at batch 64 (what `auto` should follow on this device)."""
    from vlmbatch.engine.attention import create_backend

    report: dict[str, Any] = {"positions_per_prompt": len(reference.continuations[0]) + 1, "prompts": len(reference.prompts),
                              "bound_max_rel_err": reference.bound, "transformers_low_precision": reference.transformers_low_precision,
                              "backends": {}}
    for name in backends:
        try:
            engine.runner.use_backend(create_backend(name, engine.device))
            engine.block_manager.reset_prefix_cache()
            errors = relative_errors(teacher_forced_logits(engine, reference.prompts, reference.continuations), reference.logits)
            speed = decode_roofline(engine, adapter, 64, ceilings, steps=16)
            report["backends"][name] = dict(errors, ok=errors["max_rel_err"] <= reference.bound, decode_step_ms_b64=speed["decode_step_ms"])
        except Exception as exc:  # noqa: BLE001  (a backend that fails to run is a finding, not the end)
            report["backends"][name] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-4000:]}
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
    passing = [b for b, e in report["backends"].items() if e["ok"]]
    report["fastest_backend"] = min(passing, key=lambda b: report["backends"][b]["decode_step_ms_b64"]) if passing else None
    return report


def check_async_decoding(engine, adapter, tokens: int = 24) -> dict[str, Any]:
    """Greedy tokens with decode steps launched on the previous step's samples still on
    the device against the same prompts with every step awaited, run twice to show how
    far two awaited runs agree on this device. The requests are prefilled in one step
    and run the same length, so every run steps identical batches and the tokens must be
    equal bit for bit. (With staggered finishes they need not be: a sequence that ended
    at step n still fills its row in step n + 1, so the last steps' batches differ, and
    in bf16 a different batch can flip a near-tie. The CPU tests cover staggered finishes
    and aborts in fp32.)"""
    prompts = w1_prompts(adapter, 64, seed=30_000, pixel_dtype=engine.runner.dtype)  # all of one length
    requests = min(64, engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens // prompts[0].num_tokens)
    prompts = prompts[:requests]
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


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- roofline -------------------------------------------------------------------------
def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on `device`."""

    def timed(fn: Callable[[], Any], repeats: int = 20) -> float:
        fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / repeats

    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    matmul_s = timed(lambda: a @ a, repeats=10)
    return {"copy_bytes_per_s": 2 * src.numel() / copy_s, "matmul_flops_per_s": 2 * n**3 / matmul_s}


def decode_step_cost(decoder, batch: int, context: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `batch` sequences with `context` cached tokens:
    every weight but the embedding table is read once; each sequence reads its KV."""
    params = sum(p.numel() for name, p in decoder.named_parameters() if not name.startswith("embed_tokens"))
    itemsize = decoder.embed_tokens.weight.dtype.itemsize
    layers, kv_heads, head_dim = len(decoder.layers), decoder.num_kv_heads, decoder.head_dim
    q_heads = decoder.layers[0].self_attn.num_heads
    kv_bytes = batch * context * layers * 2 * kv_heads * head_dim * itemsize
    flops = 2 * params * batch + batch * layers * 4 * context * q_heads * head_dim
    return params * itemsize + kv_bytes, flops


def decode_roofline(engine, adapter, batch: int, ceilings: dict[str, float], steps: int = 32) -> dict[str, float]:
    """Measured decode-step time at `batch` sequences (at most the engine's max_num_seqs)
    vs the time the ceilings allow."""
    batch = min(batch, engine.scheduler.max_num_seqs)
    prompts = w1_prompts(adapter, batch, seed=batch, pixel_dtype=engine.runner.dtype)
    result = run_engine(engine, prompts, [steps] * batch, f"decode-b{batch}")
    context = PROMPT_TOKENS + steps // 2
    nbytes, flops = decode_step_cost(engine.model.decoder, batch, context)
    bound_s = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])
    measured_s = result.decode_step_ms / 1000
    steps_run = max(1, result.extra["num_decode_steps"])
    return {"batch": batch, "context": context, "decode_step_ms": result.decode_step_ms, "roofline_ms": 1000 * bound_s,
            "pct_of_roofline": 100 * bound_s / measured_s, "bytes": nbytes, "flops": flops,
            "launch_ms": 1000 * result.extra["decode_launch_s"] / steps_run, "wait_ms": 1000 * result.extra["decode_wait_s"] / steps_run}


def profile_vision(engine, adapter, images: int = 56, top: int = 10) -> dict[str, Any]:
    """Wall time of the vision tower on `images` fresh W1 images in one batch (what one
    prefill step of W1 encodes) and its costliest ops: the tower dominated W1 once."""
    from torch.profiler import ProfilerActivity, profile

    prompts = w1_prompts(adapter, images, seed=20_000, pixel_dtype=engine.runner.dtype)
    items = [engine.model.split_media(p.mm_inputs, p.mm_hashes) for p in prompts]
    engine.model.encode(items[:2])  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.model.encode(items[2:])
        _sync(engine.device)
    seconds = time.perf_counter() - start
    return {"images": images - 2, "ms": 1000 * seconds,
            "ops": [{"op": name, "ms": us / 1000, "calls": calls} for name, us, calls in _costliest(prof, engine.device, top)]}


def _costliest(prof, device: torch.device, top: int) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls) of a profile's costliest ops: device time on a GPU,
    CPU time elsewhere."""
    cost = (lambda e: e.device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if cost(e) > 0), key=cost, reverse=True)
    return [(e.key[:90], cost(e), e.count) for e in events[:top]]


def profile_decode(engine, adapter, batch: int, steps: int = 8, top: int = 12) -> list[dict[str, Any]]:
    """The GPU kernels of `steps` decode steps at `batch` sequences, the costliest first
    (CUDA-graph replays included): what to fuse or tune next."""
    from torch.profiler import ProfilerActivity, profile

    batch = min(batch, engine.scheduler.max_num_seqs)
    for i, prompt in enumerate(w1_prompts(adapter, batch, seed=10_000 + batch, pixel_dtype=engine.runner.dtype)):
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


# ---- the whole benchmark ----------------------------------------------------------------
@dataclass
class BenchOptions:
    shape: str = "3b"
    model: str | None = None  # real weights instead of random ones
    requests: int = 1024
    peer_requests: int = 128  # the peer is slow: it runs this many and reports rates
    peer_batches: tuple[int, ...] = (64, 128)  # W1; W2 runs the largest only (its batches last 512 steps)
    workloads: tuple[str, ...] = ("w1", "w2")
    backends: tuple[str, ...] = ()  # attention backends to check; () = every available one
    check_prompts: int = 4
    decode_steps: int = 32
    decode_batches: tuple[int, ...] = (1, 64)
    extra_shapes: tuple[str, ...] = ("7b",)  # decode roofline only
    profile_batches: tuple[int, ...] = ()  # decode batch sizes whose kernels are profiled (main shape)
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.85
    min_admission_batch: int = 64
    async_decode: bool = True  # False: every decode step awaited (PagedEngine.async_decode)
    device: str = "auto"


def _row(r: RunResult) -> str:
    step = f"{r.decode_step_ms:8.2f}" if r.decode_step_ms else "       -"
    return f"{r.engine:18s} {r.workload:4s} {r.requests:6d} req {r.requests_per_s:9.2f} req/s {r.output_tokens_per_s:10.0f} out tok/s  decode step {step} ms"


def _phase_row(r: RunResult) -> str:
    """Where a paged run's wall time went (seconds; per-step milliseconds for decode)."""
    x = r.extra
    steps = max(1, x["num_decode_steps"])
    return (f"  phases {r.workload}: add_request {x['add_request_s']:.2f} s, vision {x['vision_s']:.2f} s, "
            f"prefill {x['prefill_launch_s']:.2f}+{x['prefill_wait_s']:.2f} s ({x['num_prefill_steps']} steps), "
            f"decode {x['decode_launch_s']:.2f}+{x['decode_wait_s']:.2f} s ({steps} steps: "
            f"{1000 * x['decode_launch_s'] / steps:.2f} ms launch + {1000 * x['decode_wait_s'] / steps:.2f} ms wait), "
            f"host {x['host_s']:.2f} s ({1000 * x['host_s'] / max(1, x['num_steps']):.2f} ms/step)  [launch+wait]")


def _roofline_row(shape: str, row: dict[str, float]) -> str:
    return (f"decode {shape} batch {row['batch']:4d}: {row['decode_step_ms']:.2f} ms/step, roofline {row['roofline_ms']:.2f} ms "
            f"= {row['pct_of_roofline']:.0f}% of roofline (launch {row['launch_ms']:.2f} + wait {row['wait_ms']:.2f} ms)")


def _summary(results: list[RunResult]) -> dict[str, Any]:
    """Our rate per workload and its ratio to the best peer batch size."""
    summary = {}
    for workload in {r.workload for r in results}:
        ours = [r for r in results if r.workload == workload and r.engine == "paged"]
        peers = [r for r in results if r.workload == workload and r.engine != "paged"]
        if ours:
            best_peer = max((p.requests_per_s for p in peers), default=None)
            summary[workload] = {"paged_requests_per_s": ours[0].requests_per_s, "best_peer_requests_per_s": best_peer,
                                 "speedup": ours[0].requests_per_s / best_peer if best_peer else None}
    return summary


def _paged_engine(adapter, hf_model, options: BenchOptions, dtype: torch.dtype, device: torch.device, max_num_seqs: int):
    from vlmbatch.engine.paged import PagedEngine

    engine = PagedEngine(
        adapter, adapter.model_path, dtype=dtype, device=str(device), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens, gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=PROMPT_TOKENS + W2_RANGE[1], hf_model=hf_model, min_admission_batch=options.min_admission_batch,
    )
    engine.async_decode = options.async_decode
    return engine


class _Phases:
    """Runs the benchmark's phases so that one failing (a backend that does not compile, an
    OOM on the 7B shapes) is recorded in the report instead of losing the others; the
    report is saved after every phase, so a run cut short still leaves its figures."""

    def __init__(self, report: dict[str, Any], save: Callable[[dict[str, Any]], None] | None, echo: Callable[[str], None]):
        self.report, self.save, self.echo = report, save, echo
        report["errors"] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001  (any failure of a phase goes into the report)
            self.report["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
            self.echo(f"{name} failed: {exc.__class__.__name__}: {exc}")
            return None
        finally:
            if self.save is not None:
                self.save(self.report)


def run_bench(options: BenchOptions, echo: Callable[[str], None] = print,
              save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Peer runs, logit checks per backend, our runs, decode rooflines; returns the report
    (`save` gets it after every phase)."""
    from vlmbatch.engine.attention import available_backends, create_backend
    from vlmbatch.models.registry import resolve_device

    device = resolve_device(options.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "options": asdict(options), "runs": [], "decode_roofline": {}}
    phases = _Phases(report, save, echo)
    ceilings = report["ceilings"] = measure_ceilings(device)
    echo(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    results: list[RunResult] = []

    def record(result: RunResult) -> None:
        results.append(result)
        report["runs"].append(dict(asdict(result), requests_per_s=result.requests_per_s, output_tokens_per_s=result.output_tokens_per_s))
        report["summary"] = _summary(results)
        echo(_row(result))
        if result.engine == "paged":
            echo(_phase_row(result))

    with tempfile.TemporaryDirectory() as tmp:
        adapter, hf_model = real_model(options.model, dtype, device) if options.model else random_model(options.shape, Path(tmp), dtype, device)
        for workload in options.workloads:
            lengths, prompts = output_lengths(workload, options.peer_requests), w1_prompts(adapter, options.peer_requests, pixel_dtype=dtype)
            for batch_size in options.peer_batches if workload == "w1" else sorted(options.peer_batches)[-1:]:
                result = phases.run(f"peer-{workload}-b{batch_size}", run_peer, hf_model, adapter, prompts, lengths, batch_size, workload, device)
                if result is not None:
                    record(result)
        reference = logit_reference(hf_model, adapter, w1_prompts(adapter, options.check_prompts, seed=7), options.decode_steps, device)
        engine = _paged_engine(adapter, hf_model, options, dtype, device, options.max_num_seqs)
        del hf_model
        report["vision_tower"] = "vlmbatch" if getattr(engine.model, "tower", None) is not None else "transformers"
        report["packed_vision_attention"] = getattr(engine.model, "packed_vision_attention", None)
        echo(f"vision tower: {report['vision_tower']} (transformers' attention batched per window length: {report['packed_vision_attention']})")
        correctness = report["correctness"] = check_backends(engine, reference, list(options.backends) or available_backends(device), adapter, ceilings)
        for name, errors in correctness["backends"].items():
            echo(_check_row(name, errors, reference.bound))
        if correctness["fastest_backend"] is not None:
            engine.runner.use_backend(create_backend(correctness["fastest_backend"], device))
        asynchronous = report["async_decoding"] = phases.run("async-decoding", check_async_decoding, engine, adapter)
        if asynchronous is not None:
            echo(f"asynchronous decoding: {asynchronous['equal']}/{asynchronous['requests']} requests with the awaited steps' tokens "
                 f"(two awaited runs: {asynchronous['awaited_repeat_equal']}/{asynchronous['requests']}) "
                 f"-> {'ok' if asynchronous['ok'] else 'FAIL'} {asynchronous['differing'] or ''}")
        for number, workload in enumerate(options.workloads):  # fresh prompts and images: no cache hits across runs
            prompts = w1_prompts(adapter, options.requests, seed=100 + number, pixel_dtype=dtype)
            result = phases.run(f"paged-{workload}", run_engine, engine, prompts, output_lengths(workload, options.requests), workload)
            if result is not None:
                record(result)
        for shape in [options.shape, *([] if options.model else options.extra_shapes)]:
            if shape != options.shape:
                del engine
                _free(device)
                engine = phases.run(f"build-{shape}", _random_engine, shape, Path(tmp), options, dtype, device)
                if engine is None:
                    continue
            for batch in options.decode_batches:
                row = phases.run(f"roofline-{shape}-b{batch}", decode_roofline, engine, engine.adapter, batch, ceilings)
                if row is not None:
                    report["decode_roofline"].setdefault(shape, []).append(row)
                    echo(_roofline_row(shape, row))
            if options.profile_batches and shape == options.shape:
                vision = phases.run("profile-vision", profile_vision, engine, engine.adapter)
                if vision is not None:
                    report["vision_profile"] = vision
                    echo(f"vision tower: {vision['images']} images in {vision['ms']:.0f} ms (profiled)")
                    for op in vision["ops"]:
                        echo(f"  {op['ms']:9.2f} ms {op['calls']:7d} calls  {op['op']}")
            for batch in options.profile_batches if shape == options.shape else ():
                kernels = phases.run(f"profile-{shape}-b{batch}", profile_decode, engine, engine.adapter, batch)
                if kernels is not None:
                    report.setdefault("decode_kernels", {})[f"{shape}-b{batch}"] = kernels
                    echo(f"decode {shape} batch {batch} kernels per step:")
                    for k in kernels:
                        echo(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f} calls  {k['kernel']}")
        del engine
        _free(device)
    report["ok"] = (bool(correctness["backends"]) and all(e["ok"] for e in correctness["backends"].values())
                    and bool(report.get("async_decoding") and report["async_decoding"]["ok"]))
    if save is not None:
        save(report)
    return report


def _random_engine(shape: str, workdir: Path, options: BenchOptions, dtype: torch.dtype, device: torch.device):
    adapter, hf_model = random_model(shape, workdir, dtype, device)
    return _paged_engine(adapter, hf_model, options, dtype, device, max(options.decode_batches))


def _check_row(name: str, errors: dict[str, Any], bound: float) -> str:
    if "error" in errors:
        return f"logits vs transformers fp32 [{name}]: FAILED to run ({errors['error'].splitlines()[-1]})"
    return (f"logits vs transformers fp32 [{name}]: max rel err {errors['max_rel_err']:.2e} (bound {bound:.2e}), "
            f"top-1 agreement {100 * errors['top1_agreement']:.1f}%, decode step b64 {errors['decode_step_ms_b64']:.2f} ms "
            f"-> {'ok' if errors['ok'] else 'FAIL'}")
