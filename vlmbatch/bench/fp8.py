"""`vlmbatch bench kernels --sections fp8`: FP8 products against bf16 cuBLAS on 3B/7B shapes.

Each row times one layer's product, activation quantization included, in a CUDA graph over
weights cycled past the L2 (as a decode step reads them): bf16 `F.linear`; the block layout
(1x128 activation groups, 128x128 weight blocks) on our Triton GEMM; the per-channel layout
on our Triton GEMM and on cuBLAS (`torch._scaled_mm`). `KernelSet.fp8`'s rule (Triton up
to `FP8_TRITON_MAX_ROWS` rows, cuBLAS above, for per-channel weights) is read off this table.

Up to 64 rows it also times what `Fp8Linear` runs there (`fp8 channel plan` / `fp8 block
plan`: `kernels.fp8.fp8_linear` with `fp8.decode_plan`'s launch, named in the variant) and,
at 1, 16 and 64 rows, the sweep around it, each after the quantization kernel: unsplit
tiles (`fp8 channel triton bn/bk/w`, `fp8.FP8_DECODE_TILES`; bn32/bk256/w4 was session 8's
default) and tiles split over K (`fp8 channel split bn/bk/w/s`, `fp8.FP8_SPLIT_TILES`; `fp8
block split` for those with 128-column K steps).
`fp8 channel triton` and `fp8 block triton` are the quantization kernel and `fp8_gemm`'s
default launch (the plan's up to 64 rows). `error` says why a variant failed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from vlmbatch.kernels.fp8 import (FP8_DECODE_TILES, FP8_SPLIT_TILES, Fp8GemmConfig, decode_config, decode_plan, fp8_gemm, fp8_linear,
                                  quantize_fp8, scaled_mm, scaled_mm_blocks)
from vlmbatch.kernels.decode_attention import sm_count
from vlmbatch.kernels.reference import dequantize_fp8_ref, quantize_fp8_blocks_ref, quantize_fp8_ref
from vlmbatch.testing.fp8_checkpoints import quantization_config

FP8_ROWS = (1, 4, 16, 32, 64, 256, 2048)
FP8_SWEEP_ROWS = (1, 16, 64)  # rows with the whole sweep; the others time bf16, the plans and this morning's default tile

# Logit bound of FP8 (w8a8 e4m3) against fp32 transformers on the same (round-tripped)
# weights where the reference cannot round the activations as our kernels do (the MoE
# experts' inner product): the weights are then exact, but every linear layer's input is
# rounded to e4m3 (3 mantissa bits: relative error up to 2^-4, ~2^-4/sqrt(12) ≈ 1.8% RMS
# per element), which bf16 (2^-9) is 32x finer than; the bf16 floor of 2e-2 times that
# margin, capped, gives 0.15 of relative L2 per position. Where the reference rounds every
# FP8 layer's input itself (`simulate_fp8_activations`), both compute the same function and
# the bf16 rule applies.
FP8_MIN_BOUND = 0.15


def _fp8_modules(hf_model: torch.nn.Module, vision: bool = False) -> Iterator[tuple[str, torch.nn.Module]]:
    """("linear", module) for each decoder projection of `hf_model`'s language model and
    ("experts", module) for each MoE expert set: what our engine runs in FP8; with `vision`
    also ("vision", module) for every other linear layer of `hf_model.model` (the tower and
    projector) but patch embeddings, as `quantize_vision` converts them
    (`engine.fp8_loading.quantize_linears`: always per channel)."""
    language_model = hf_model.get_decoder()  # `language_model`, or `text_model` (Idefics3, SmolVLM)
    for name, module in language_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1].endswith("_proj") and ".layers." in f".{name}":
            yield "linear", module
        elif name.endswith("mlp.experts"):
            yield "experts", module
    if vision:
        in_language_model = {id(m) for m in language_model.modules()}
        for name, module in hf_model.model.named_modules():
            if (isinstance(module, torch.nn.Linear) and id(module) not in in_language_model
                    and "patch_embed" not in name.rsplit(".", 1)[-1]):
                yield "vision", module


@torch.no_grad()
def round_trip_fp8_layers(hf_model: torch.nn.Module, quantization: str, vision: bool = False) -> int:
    """Replace the layers our engine runs in FP8 (`_fp8_modules`) by their fp8 round trip in
    the layout `quantization` names for the decoder (`fp8`: per channel, `fp8-block`:
    128x128; the tower's always per channel), what our engine then runs, in place; returns
    how many."""
    def round_trip(w: torch.Tensor, blocks: bool) -> torch.Tensor:
        q, s = quantize_fp8_blocks_ref(w.float()) if blocks else quantize_fp8_ref(w.float(), None)
        return dequantize_fp8_ref(q, s).to(w.dtype)

    count = 0
    for kind, module in _fp8_modules(hf_model, vision):
        blocks = quantization == "fp8-block" and kind != "vision"
        if kind == "experts":  # [E, 2I, H] gate rows first, [E, H, I]: each expert's gate, up, down alone
            for gate_up, down in zip(module.gate_up_proj, module.down_proj):
                half = gate_up.shape[0] // 2
                gate_up.copy_(torch.cat([round_trip(gate_up[:half], blocks), round_trip(gate_up[half:], blocks)]))
                down.copy_(round_trip(down, blocks))
        else:
            module.weight.copy_(round_trip(module.weight, blocks))
        count += 1
    return count


def simulate_fp8_activations(hf_model: torch.nn.Module, quantization: str, vision: bool = False) -> bool:
    """Round the input of every FP8 layer of `hf_model` (`_fp8_modules`) to e4m3 as our FP8
    layers do on the GPU (per token, or in 1x128 groups for `fp8-block` decoder layers), in
    the model's own precision, by forward pre-hooks: with `round_trip_fp8_layers` the
    reference then computes our engine's w8a8 function. True when that covers every FP8
    layer; False when MoE experts (whose inner activation no hook reaches) are present."""
    def rounded(group: int | None) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> tuple:
            x = args[0]
            q, scales = quantize_fp8_ref(x.reshape(-1, x.shape[-1]), group)
            return (dequantize_fp8_ref(q, scales).view(x.shape).to(x.dtype), *args[1:])
        return hook

    complete = True
    for kind, module in _fp8_modules(hf_model, vision):
        if kind == "experts":
            complete = False
        else:
            module.register_forward_pre_hook(rounded(128 if quantization == "fp8-block" and kind == "linear" else None))
    return complete


def vllm_model_folder(folder: Path, quantization: str) -> Path:
    """A copy of the bench model folder whose config.json names the published checkpoint
    format of `quantization` (compressed-tensors per channel for `fp8`, Qwen's block-wise
    for `fp8-block`): vLLM's dummy loader then builds and runs that format's own layers.
    The block-wise list of modules left unquantized names each one in full, as Qwen's
    `-FP8` releases do: vLLM matches those names exactly (session 15: with the short names
    it quantized the Qwen3-VL tower's 4304-wide MLP and failed to start)."""
    target = folder.with_name(f"{folder.name}-{quantization}")
    shutil.copytree(folder, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config("fp8-block" if quantization == "fp8-block" else "fp8-dynamic")
    if quantization == "fp8-block":
        config["quantization_config"]["modules_to_not_convert"] = unquantized_linear_names(folder)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def unquantized_linear_names(folder: Path) -> list[str]:
    """The full names (transformers' own) of the model's matrix layers that our engine does
    not run in FP8 (`_fp8_modules`): the vision tower's and projector's, `lm_head`, the MoE
    routers (transformers' router is no `nn.Linear`, vLLM's is). The model is built on the
    meta device: no weights are made."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    in_fp8 = {id(module) for _, module in _fp8_modules(model)}
    return [name for name, module in model.named_modules()
            if id(module) not in in_fp8 and not isinstance(module, torch.nn.Embedding)
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2]


def launch_name(config: Fp8GemmConfig) -> str:
    return f"bn{config.block_n}/bk{config.block_k}/w{config.num_warps}/s{config.split_k}"


def bench_fp8_linear(device: torch.device, copy_tb_s: float, shapes: dict, graph_ms_per_call: Callable, bytes_per_graph: int,
                     rows: tuple[int, ...] = FP8_ROWS) -> list[dict]:  # fmt: skip
    """One row per (model, layer, rows, variant); rel_err against bf16 `F.linear` on the
    unquantized weight (the first of each cycle). `shapes`, `graph_ms_per_call` and
    `bytes_per_graph` are `bench.kernels`' (the bf16 linear section's)."""
    from triton.runtime.errors import OutOfResources

    out = []
    for model, layers in shapes.items():
        for name, n, k in layers:
            count = max(1, bytes_per_graph // (n * k))
            base = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            bf16 = [base] + [torch.randn_like(base) for _ in range(max(1, count // 2) - 1)]
            block = [quantize_fp8_blocks_ref(base.float())] + [_random_fp8(n, k, (-(-n // 128), -(-k // 128)), device) for _ in range(count - 1)]
            channel = [quantize_fp8_ref(base.float(), None)] + [_random_fp8(n, k, (n, 1), device) for _ in range(count - 1)]
            for num_rows in rows:
                x = torch.randn(num_rows, k, device=device, dtype=torch.bfloat16)
                expected = F.linear(x, base).float()
                decode, sweep = num_rows <= 64, num_rows in FP8_SWEEP_ROWS

                def add(variant: str, fn: Callable, weights: list, nbytes: int) -> None:
                    try:
                        result = fn(weights[0])
                    except OutOfResources:  # a launch whose tiles do not fit in shared memory
                        return
                    except Exception as exc:  # noqa: BLE001 - one variant failing must not end the run: the row says why
                        out.append({"model": model, "layer": name, "rows": num_rows, "variant": variant, "error": repr(exc)[:300]})
                        return
                    ms = graph_ms_per_call(fn, weights)
                    out.append({"model": model, "layer": name, "rows": num_rows, "variant": variant, "us": 1000 * ms,
                                "weight_tb_s": nbytes / ms / 1e9, "pct_of_copy": 100 * nbytes / ms / 1e9 / copy_tb_s,
                                "rel_err": ((result.float() - expected).norm() / expected.norm()).item()})  # fmt: skip

                add("bf16 cublas", lambda w: F.linear(x, w), bf16, 2 * n * k)
                if decode:
                    for group, layout, weights in ((None, "channel", channel), (128, "block", block)):
                        plan = decode_plan(num_rows, n, k, group is None, sm_count(device))  # what `fp8_linear` runs
                        add(f"fp8 {layout} plan: quantize + {launch_name(plan)}", lambda w, g=group: fp8_linear(x, *w, group=g), weights, n * k)
                if not decode or sweep:
                    add("fp8 block triton", lambda w: fp8_gemm(*quantize_fp8(x, 128), *w), block, n * k)
                    add("fp8 channel triton", lambda w: fp8_gemm(*quantize_fp8(x), *w), channel, n * k)
                for tile in FP8_DECODE_TILES if sweep else ((32, 256, 4),) if decode else ():
                    config = decode_config(num_rows, *tile)
                    add("fp8 channel triton bn{}/bk{}/w{}".format(*tile),
                        lambda w, config=config: fp8_gemm(*quantize_fp8(x), *w, config=config), channel, n * k)
                for tile in FP8_SPLIT_TILES if sweep else ():
                    config = decode_config(num_rows, *tile)
                    for group, layout, weights in ((None, "channel", channel), (128, "block", block)):
                        if group is None or tile[1] == 128:  # block weights step by their 128-column groups
                            add(f"fp8 {layout} split {launch_name(config)}", lambda w, config=config, g=group: fp8_gemm(*quantize_fp8(x, g), *w, config=config),
                                weights, n * k)  # fmt: skip
                if n % 16 == 0 and k % 16 == 0 and (not decode or sweep):
                    add("fp8 channel cublas", lambda w: scaled_mm(*quantize_fp8(x), *w), channel, n * k)
                if not decode:  # the candidate for block weights in prefill (an error row where cuBLAS refuses the shape)
                    add("fp8 block cublas", lambda w: scaled_mm_blocks(*quantize_fp8(x, 128), *w), block, n * k)
            del bf16, block, channel
    return out


def best_fp8_rows(rows: list[dict]) -> list[dict]:
    """Per (model, layer, rows): bf16 cuBLAS, the plans, and the fastest FP8 variant of each
    layout, with the plan's time against bf16 (`vs_bf16` < 1: FP8 is faster)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["layer"], row["rows"]), []).append(row)
    out = []
    for key, group in groups.items():
        bf16 = next((r for r in group if r["variant"] == "bf16 cublas"), None)
        picked = [r for r in group if r["variant"].startswith(("fp8 channel plan", "fp8 block plan"))]
        for layout in ("channel", "block"):
            candidates = [r for r in group if r["variant"].startswith(f"fp8 {layout}") and "plan" not in r["variant"] and "us" in r]
            if candidates:
                best = min(candidates, key=lambda r: r["us"])
                picked.append({**best, "variant": f"best: {best['variant']}"})
        for row in (r for r in picked if "us" in r):
            out.append({**row, "bf16_us": bf16["us"] if bf16 else None, "vs_bf16": row["us"] / bf16["us"] if bf16 else None})
    return out


def _random_fp8(n: int, k: int, scale_shape: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, k, device=device).to(torch.float8_e4m3fn), torch.rand(scale_shape, device=device) * 1e-3
