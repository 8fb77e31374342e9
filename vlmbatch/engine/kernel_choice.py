"""The kernels a model is built with, chosen once from the engine configuration and device.

Modules receive their kernels when they are constructed (norms, rotary, the gated MLP's
activation, decode-sized linear products) and never switch afterwards, so what a model
runs is decided in one place and logged at start-up. Triton's elementwise kernels come
with the triton attention backend (on CUDA, or on the CPU under `TRITON_INTERPRET=1` in
the kernel tests); every other backend runs plain PyTorch around its attention.
"""

from __future__ import annotations

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
        return f"{self.name} norms/rotary/activation, decode linear {self.decode_linear}, {pdl}"


TORCH_KERNELS = KernelSet("torch", None, apply_rotary, silu_and_mul, None, "cublas", 0)


def choose_kernels(config: EngineConfig, device: torch.device, attention_backend: str) -> KernelSet:
    """Triton kernels alongside the triton attention backend, plain PyTorch otherwise."""
    if attention_backend != "triton":
        return TORCH_KERNELS
    kernels = importlib.import_module("vlmbatch.kernels")
    pdl = PDL_MAX_BATCH if config.pdl and device.type == "cuda" and kernels.pdl.device_supports_pdl(device.index or 0) else 0

    def bound(kernel: Callable) -> Callable:
        return functools.partial(kernel, pdl_max_rows=pdl)

    return KernelSet("triton", bound(kernels.rms_norm), bound(kernels.apply_rotary), bound(kernels.fused_silu_and_mul),
                     bound(kernels.skinny_linear), config.decode_linear, pdl, bound(kernels.fused_gelu_tanh_and_mul))
