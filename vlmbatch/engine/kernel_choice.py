"""The kernels a model is built with, chosen once from the engine configuration and device.

Modules receive their kernels when they are constructed (norms, rotary, the gated MLP's
activation, decode-sized linear products) and never switch afterwards, so what a model
runs is decided in one place and logged at start-up. Triton's elementwise kernels come
with the triton attention backend (on CUDA, or on the CPU under `TRITON_INTERPRET=1` in
the kernel tests); every other backend runs plain PyTorch around its attention.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmbatch.config import EngineConfig
from vlmbatch.engine.layers.activation import gelu_tanh_and_mul, silu_and_mul
from vlmbatch.engine.layers.rotary import apply_rotary

# Decode graphs of up to this many sequences launch their Triton kernels with programmatic
# dependent launch (`vlmbatch.kernels.pdl`): -3% step time at batch 1 on the H200, +3-5% at
# batch 64 (BENCHMARKS.md, session 4).
PDL_MAX_BATCH = 16

# FP8 per-channel products of at most this many rows run on our Triton GEMM, larger ones
# on cuBLAS (`torch._scaled_mm`); block-scaled products always on the Triton GEMM.
# From `vlmbatch bench kernels --sections fp8` on the H200 (BENCHMARKS.md).
FP8_TRITON_MAX_ROWS = 64


@dataclass(frozen=True)
class Fp8Gemms:
    """The kernels of FP8 linear layers (`layers/fp8_linear.py`), chosen once per model."""

    quantize: Callable  # (x [M, K], group | None) -> (fp8 [M, K], float32 scales [M, groups])
    gemm: Callable  # `kernels.fp8_gemm`: either scale layout
    scaled_mm: Callable  # `kernels.fp8.scaled_mm`: cuBLAS, per-token x per-channel only
    triton_max_rows: int  # per-channel products of more rows go to `scaled_mm` where it applies
    scaled_mm_shapes: Callable[[int, int], bool]  # (N, K) -> whether cuBLAS takes them
    rms_norm: Callable  # `kernels.rms_norm_fp8`: a norm whose output an FP8 layer takes, written in FP8
    gated: Callable  # `kernels.gated_fp8`: the gated activation written in FP8 for the down projection


@dataclass(frozen=True)
class SkinnyLinear:
    """A decode-sized product through the skinny-GEMM kernel, for inputs of at most `max_rows` rows."""

    kernel: Callable
    max_rows: int


@dataclass(frozen=True)
class KernelSet:
    """What the model's modules compute with; `rms_norm`/`skinny_linear` None mean plain PyTorch."""

    name: str  # "triton" or "torch"
    rms_norm: Callable | None
    rotary: Callable
    silu_and_mul: Callable
    skinny_linear: Callable | None
    decode_linear: str
    pdl_max_rows: int
    fp8: Fp8Gemms | None = None  # FP8 GEMMs (CUDA); None: FP8 weights are dequantized at load
    gelu_tanh_and_mul: Callable = gelu_tanh_and_mul  # GeGLU (Gemma)

    def skinny(self, measured_rows: int = 0, launch: dict[str, int] | None = None) -> SkinnyLinear | None:
        """The skinny-GEMM choice of one layer, as `decode_linear` says: `auto` takes the rows
        and launch shape measured for the layer (none measured: cuBLAS), `skinny` every layer
        up to the kernel's limit with its default launch, `cublas` none."""
        if self.skinny_linear is None or self.decode_linear == "cublas" or (self.decode_linear == "auto" and not measured_rows):
            return None
        kernels = importlib.import_module("vlmbatch.kernels")
        if self.decode_linear == "auto":
            return SkinnyLinear(functools.partial(self.skinny_linear, config=kernels.SkinnyConfig(**(launch or {}))), measured_rows)
        return SkinnyLinear(self.skinny_linear, kernels.skinny_gemm.MAX_ROWS)

    def describe(self) -> str:
        pdl = f"PDL up to {self.pdl_max_rows} rows in decode graphs" if self.pdl_max_rows else "no PDL"
        fp8 = f", fp8 GEMMs triton up to {self.fp8.triton_max_rows} rows (fp8.decode_plan) then cuBLAS" if self.fp8 else ""
        return f"{self.name} norms/rotary/activation, decode linear {self.decode_linear}, {pdl}{fp8}"


TORCH_KERNELS = KernelSet("torch", None, apply_rotary, silu_and_mul, None, "cublas", 0)


def fp8_gemms(device: torch.device, pdl_max_rows: int = 0) -> Fp8Gemms | None:
    """FP8 GEMMs where they run (CUDA with e4m3 tensor cores, SM 8.9+); None elsewhere."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    kernels = importlib.import_module("vlmbatch.kernels")
    bound = functools.partial(_with_pdl, pdl_max_rows=pdl_max_rows)
    scaled_mm = functools.partial(kernels.fp8.scaled_mm, bias_in_gemm=kernels.fp8.scaled_mm_takes_bias(device))
    return Fp8Gemms(bound(kernels.quantize_fp8), bound(kernels.fp8_gemm), scaled_mm, FP8_TRITON_MAX_ROWS,
                    kernels.fp8.scaled_mm_supported, bound(kernels.rms_norm_fp8), bound(kernels.gated_fp8))  # fmt: skip


def _with_pdl(kernel: Callable, pdl_max_rows: int) -> Callable:
    """`kernel` with the engine's PDL limit bound (`kernels.pdl.pdl_launch`)."""
    return functools.partial(kernel, pdl_max_rows=pdl_max_rows)


def choose_kernels(config: EngineConfig, device: torch.device, attention_backend: str) -> KernelSet:
    """Triton kernels alongside the triton attention backend, plain PyTorch otherwise; FP8
    GEMMs on a GPU that has them, whatever the backend."""
    if attention_backend != "triton":
        return dataclasses.replace(TORCH_KERNELS, fp8=fp8_gemms(device))
    kernels = importlib.import_module("vlmbatch.kernels")
    pdl = PDL_MAX_BATCH if config.pdl and device.type == "cuda" and kernels.pdl.device_supports_pdl(device.index or 0) else 0
    bound = functools.partial(_with_pdl, pdl_max_rows=pdl)
    return KernelSet("triton", bound(kernels.rms_norm), bound(kernels.apply_rotary), bound(kernels.fused_silu_and_mul),
                     bound(kernels.skinny_linear), config.decode_linear, pdl, fp8_gemms(device, pdl),
                     bound(kernels.fused_gelu_tanh_and_mul))
