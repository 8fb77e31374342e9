"""`vlmbatch bench tower`: our vision tower against `transformers`' on the same weights and images.

    vlmbatch bench tower [--model-shape qwen3_vl_8b] [--images 64] [--device auto] [--json bench-out/tower.json] [--profile]
                         [--sdpa-backends flash,cudnn,efficient] [--quantize-vision]

One `transformers` model of the shape with random weights (bf16 on a GPU, fp32 on the
CPU; its language model dropped once built); our tower (the family's `tower_class`) is
built from its vision weights as the engine builds it, with the engine's kernels. Both
encode the same batch of W1 images (448x448 through the model's own processor, as a
prefill step hands them over): a warm-up call, then the median of 5 timed calls each.
Printed and written: ms per image, the FLOPs of one call (`FlopCounterMode`; it counts
SDPA's on the GPU, not the CPU's SDPA kernel) and TFLOP/s,
and the relative L2 error of ours against `transformers`' output (each block of columns:
the merged features, then each DeepStack level), which should be bf16 rounding. `--profile`
adds one profiled call of each: its top kernels by device time (what shows whether the
copies around attention are gone). `--sdpa-backends` also times ours with PyTorch's SDPA
held to each named backend (flash, cudnn, efficient, math), with its error.
`--quantize-vision` also times a copy of ours with its linear layers in FP8 as the engine's
`quantize_vision` builds it (per-channel weights, per-token activations; on the GPU the
FP8 GEMMs, on the CPU the dequantized weights), with its error against `transformers`'
bf16 tower, which is FP8's rounding rather than bf16's.

The SigLIP families (Gemma 3, LLaVA-OneVision, Idefics3/SmolVLM: `engine/layers/siglip.py`;
InternVL's InternViT, `engine/layers/internvit.py`, its variant with a CLS token)
compare the tower's features as the family reads them (Gemma 3 and Idefics3: the
post-layernormed last layer; LLaVA-OneVision: `vision_feature_layer`'s hidden states) over
every tile of the batch's images (one 896 px crop an image on Gemma 3; OneVision's and
SmolVLM's tilings give several), before the projector / connector, which stays
`transformers`'.

Only shapes whose family has a tower of ours run (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, the
SigLIP families and InternVL); others are refused, naming those that do.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vlmbatch.bench.shapes import SHAPES, ModelShape, ShapeError

TIMED_CALLS = 5
FP8_ROW = "vlmbatch fp8"  # ours with `quantize_vision`
WORKLOAD_SEED = 7


def _engine_model(family: str) -> Any:
    from vlmbatch.families.registry import FAMILIES

    registered = FAMILIES.get(family)
    return None if registered is None else registered.parts().ENGINE_MODEL


def tower_class(family: str) -> Any:
    """The family's own vision tower class, or None where the engine runs `transformers`'."""
    return getattr(_engine_model(family), "tower_class", None)


def check_shape(shape: ModelShape) -> None:
    """`ShapeError` unless `shape`'s family has a tower of ours."""
    if tower_class(shape.family) is None:
        ours = sorted(name for name, s in SHAPES.items() if tower_class(s.family) is not None)
        raise ShapeError(f"{shape.name}: the {shape.family} family runs transformers' vision tower, there is none of ours "
                         f"to compare; shapes whose family has one: {', '.join(ours)}")


def transformers_features(hf_model: torch.nn.Module, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """What the engine took from `transformers`' tower before it had its own: the merged
    features, then each DeepStack level (Qwen3-VL), side by side."""
    from vlmbatch.engine.vision_language import pooled

    if getattr(hf_model.config.vision_config, "deepstack_visual_indexes", None):
        output = hf_model.model.get_image_features(pixels, grids, return_dict=True)
        return torch.cat([torch.cat(output.pooler_output), *[torch.cat(level) for level in output.deepstack_features]], dim=-1)
    return pooled(hf_model.model.get_image_features(pixels, grids))


def w1_items(path: Path, images: int, dtype: torch.dtype) -> list[Any]:
    """The media items of `images` W1 images, through the product's adapter."""
    from vlmbatch.bench.adapt import engine_prompts
    from vlmbatch.bench.workloads import build_workload
    from vlmbatch.families.registry import load_adapter

    adapter = load_adapter(str(path))
    return [item for prompt in engine_prompts(build_workload("w1", adapter, images, WORKLOAD_SEED), adapter, dtype)
            for item in prompt.media]


def w1_batch(path: Path, images: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels (on `device`, in `dtype`) and grids of `images` W1 images (Qwen-VL items)."""
    items = w1_items(path, images, dtype)
    pixels = torch.cat([item.tensors["pixel_values"] for item in items]).to(device)
    return pixels, torch.cat([item.tensors["image_grid_thw"] for item in items])


def _qwen_subject(shape: ModelShape, hf_model: torch.nn.Module, path: Path, images: int, dtype: torch.dtype,
                  device: torch.device, kernels: Any, fp8: bool) -> dict[str, Any]:
    pixels, grids = w1_batch(path, images, dtype, device)
    tower = tower_class(shape.family).from_hf(hf_model.model.visual, device, dtype, kernels)
    grids_on_device = grids.to(device)
    fp8_tower = _in_fp8(tower_class(shape.family).from_hf(hf_model.model.visual, device, dtype, kernels), kernels, dtype) if fp8 else None
    return {"ours": lambda: tower(pixels, grids), "theirs": lambda: transformers_features(hf_model, pixels, grids_on_device),
            "ours_fp8": (lambda: fp8_tower(pixels, grids)) if fp8 else None,
            "levels": 1 + len(getattr(hf_model.config.vision_config, "deepstack_visual_indexes", None) or []),
            "patches": int(grids.prod(-1).sum()), "grids": sorted({tuple(g) for g in grids.tolist()})}


def _siglip_subject(shape: ModelShape, hf_model: torch.nn.Module, path: Path, images: int, dtype: torch.dtype,
                    device: torch.device, kernels: Any, fp8: bool) -> dict[str, Any]:
    """Every tile of the W1 images through both SigLIP towers, as the family hands them over."""
    model_class = _engine_model(shape.family)
    pixels = torch.cat([item.tensors["pixel_values"].reshape(-1, *item.tensors["pixel_values"].shape[-3:])
                        for item in w1_items(path, images, dtype)]).to(device, dtype)
    tower = model_class.siglip_from_hf(hf_model, device, dtype)
    if tower is None:
        theirs = type(getattr(hf_model.model, model_class.siglip_attr)).__name__
        raise ShapeError(f"{shape.name}: its vision tower ({theirs}) is not one ours rebuilds")
    patch = tower.embeddings.patch
    fp8_tower = _in_fp8(model_class.siglip_from_hf(hf_model, device, dtype), kernels, dtype) if fp8 else None
    return {"ours": lambda: tower(pixels), "theirs": lambda: model_class.transformers_hidden(hf_model, pixels), "levels": 1,
            "ours_fp8": (lambda: fp8_tower(pixels)) if fp8 else None,
            "patches": len(pixels) * (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch), "tiles": len(pixels),
            "grids": [(len(pixels), pixels.shape[-2] // patch, pixels.shape[-1] // patch)]}


def _in_fp8(tower: torch.nn.Module, kernels: Any, dtype: torch.dtype) -> torch.nn.Module:
    """`tower` as the engine's `quantize_vision` converts it."""
    from vlmbatch.engine.fp8_loading import quantize_vision_modules

    quantize_vision_modules([tower], kernels, dtype)
    return tower


# `--sdpa-backends` names -> PyTorch's SDPA backends (`torch.nn.attention.SDPBackend`)
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def with_sdpa_backend(encode, name: str):
    """`encode` with PyTorch's SDPA held to one backend: the towers call SDPA on strided
    q/k/v views, which some backends take as they are and others copy (the OneVision
    tower's profile on the H200 showed 110 copies, 8% of its time, beside cuDNN attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def call():
        with sdpa_kernel([backend]):
            return encode()

    return call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_tower(encode, device: torch.device, images: int) -> dict[str, Any]:
    """A warm-up call, then the median of `TIMED_CALLS`, and the FLOPs of one call."""
    from torch.utils.flop_counter import FlopCounterMode

    encode()
    times = []
    for _ in range(TIMED_CALLS):
        _sync(device)
        start = time.perf_counter()
        encode()
        _sync(device)
        times.append(1000 * (time.perf_counter() - start))
    counter = FlopCounterMode(display=False)
    with counter:
        encode()
    median = statistics.median(times)
    flops = counter.get_total_flops()
    return {"median_ms": median, "ms_per_image": median / images, "times_ms": times, "flops": flops,
            "tflops_per_s": flops / median / 1e9}


@torch.no_grad()
def top_kernels(encode, device: torch.device, top: int = 16) -> list[dict[str, Any]]:
    """One profiled call of `encode`: its `top` kernels by device time (CPU: ops by self CPU
    time), each with its calls, ms and share of the call's total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        encode()
        _sync(device)
    events = prof.key_averages()

    def time_us(event: Any) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) if cuda else event.self_cpu_time_total

    total = sum(time_us(e) for e in events) or 1.0
    rows = sorted(events, key=time_us, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "ms": time_us(e) / 1000, "share": time_us(e) / total} for e in rows]


@torch.no_grad()
def run_tower_bench(shape: ModelShape, images: int, device: torch.device, profile: bool = False,
                    sdpa_backends: tuple[str, ...] = (), quantize_vision: bool = False) -> dict[str, Any]:
    """Both towers on one W1 batch of `images`, ours also under each of `sdpa_backends` and,
    with `quantize_vision`, in FP8; the report `run` prints and writes."""
    from vlmbatch.bench.shapes import random_hf_model, write_model_folder
    from vlmbatch.config import EngineConfig
    from vlmbatch.engine.attention import resolve_backend
    from vlmbatch.engine.kernel_choice import choose_kernels

    check_shape(shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_class = _engine_model(shape.family)
    backend, _ = resolve_backend("auto", device)
    kernels = choose_kernels(EngineConfig(), device, backend)
    subject = _siglip_subject if hasattr(model_class, "siglip_from_hf") else _qwen_subject
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_folder(shape, Path(tmp))
        hf_model = random_hf_model(path, dtype, device)
        setattr(hf_model.model, model_class.language_model_attr, None)  # only the tower is timed
        hf_model.lm_head = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        run = subject(shape, hf_model, path, images, dtype, device, kernels, quantize_vision)
    theirs, ours, levels = run["theirs"](), run["ours"](), run["levels"]
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(ours.chunk(levels, -1), theirs.chunk(levels, -1))]
    del ours, theirs
    report = {
        "benchmark": "tower", "model_shape": shape.name, "family": shape.family, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "kernels": kernels.describe(), "images": images,
        "patches": run["patches"], "tiles": run.get("tiles"), "grids": run["grids"],
        "relative_error": max(errors), "relative_error_per_level": errors,
        "transformers": time_tower(run["theirs"], device, images),
        "vlmbatch": time_tower(run["ours"], device, images),
    }
    report["speedup"] = report["transformers"]["median_ms"] / report["vlmbatch"]["median_ms"]
    variants = {f"vlmbatch sdpa={name}": with_sdpa_backend(run["ours"], name) for name in sdpa_backends}
    if run["ours_fp8"] is not None:
        variants[FP8_ROW] = run["ours_fp8"]
    for name, encode in variants.items():
        try:
            report[name] = time_tower(encode, device, images)
        except RuntimeError as exc:  # a backend that cannot take these shapes says so
            report[name] = {"error": str(exc).splitlines()[0]}
            continue
        ours, theirs = encode(), run["theirs"]()
        report[name]["relative_error"] = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    if profile:
        encoders = {"transformers": run["theirs"], "vlmbatch": run["ours"], **variants}
        report["profile"] = {name: top_kernels(encode, device) for name, encode in encoders.items() if "error" not in report[name]}
    return report


def run(shape: ModelShape, images: int, device: torch.device, json_out: Path | None, profile: bool = False,
        sdpa_backends: tuple[str, ...] = (), quantize_vision: bool = False) -> dict[str, Any]:
    """The command: the bench, its table on stdout, the report written to `json_out`."""
    from rich.console import Console
    from rich.table import Table

    report = run_tower_bench(shape, images, device, profile, sdpa_backends, quantize_vision)
    table = Table(title=f"vision tower: {shape.name}, {images} W1 images ({report['patches']:,} patches), "
                        f"{report['dtype']} on {report['device_name']}")
    for column in ("tower", "ms / image", "ms / batch", "GFLOP / image", "TFLOP/s", "speed-up"):
        table.add_column(column, justify="right")
    for name in ("transformers", "vlmbatch", *(f"vlmbatch sdpa={b}" for b in sdpa_backends), *([FP8_ROW] if quantize_vision else [])):
        row = report[name]
        if "error" in row:
            table.add_row(name, row["error"][:60], "", "", "", "")
            continue
        speedup = report["transformers"]["median_ms"] / row["median_ms"]
        table.add_row(name, f"{row['ms_per_image']:.3f}", f"{row['median_ms']:.1f}", f"{row['flops'] / images / 1e9:.3g}",
                      f"{row['tflops_per_s']:.3g}", f"{speedup:.2f}x")
    console = Console()
    console.print(table)
    levels = ", ".join(f"{e:.2e}" for e in report["relative_error_per_level"])
    which = " (merged, then each DeepStack level)" if len(report["relative_error_per_level"]) > 1 else ""
    console.print(f"relative error, ours vs transformers{which}: {levels}")
    for name, rows in report.get("profile", {}).items():
        console.print(f"top kernels, {name}: " + "; ".join(f"{r['name'][:60]} x{r['calls']} {r['ms']:.2f} ms ({r['share']:.0%})"
                                                           for r in rows))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    return report
