"""RMSNorm computed as `transformers` does (fp32 statistics, weight applied in the input dtype)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vlmbatch.engine.layers.fp8_linear import Fp8Activation, Fp8Linear


class RMSNorm(nn.Module):
    """`kernel`: a fused add+norm with the same rounding (`KernelSet.rms_norm`), or None for PyTorch."""

    offset = False  # the weight applied as (1 + w): Gemma's (`OffsetRMSNorm`)

    def __init__(self, hidden_size: int, eps: float, kernel: Callable | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = kernel
        self.fp8_kernel: Callable | None = None  # set by `emit_fp8_for`

    def emit_fp8_for(self, linear: nn.Module) -> None:
        """Hand `linear`, this norm's only consumer, its input already quantized when it is an
        FP8 layer and this norm runs on the Triton kernels (`Fp8Gemms.rms_norm`)."""
        if isinstance(linear, Fp8Linear) and self.kernel is not None:
            self.fp8_kernel = linear.input_quantizer(linear.gemms.rms_norm, offset=self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the decoder keeps the sum as the next residual."""
        if self.fp8_kernel is not None:
            q, scale, summed = self.fp8_kernel(x, self.weight, self.eps, residual)
            return Fp8Activation(q, scale, x.dtype), summed
        if self.kernel is not None:
            return (self.kernel(x, self.weight, self.eps), x) if residual is None else self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), x


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied as (1 + w),
    with the product in fp32 and one rounding at the end (`Gemma3RMSNorm`), where Llama's
    rounds the normalised value before the weight. `kernel`: the fused norm, called with
    `offset=True`."""

    offset = True

    def __init__(self, hidden_size: int, eps: float, kernel: Callable | None = None):
        super().__init__(hidden_size, eps, functools.partial(kernel, offset=True) if kernel is not None else None)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        if self.kernel is not None:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype), x


@dataclass(frozen=True)
class HeadNorms:
    """The RMSNorms over each head of q and k that run before rotary (Qwen3, Gemma 3).
    Attention backends receive them with the rotary step: the triton backend applies them
    inside its rotary kernel (`fused_weights`), the others call the modules."""

    q: RMSNorm
    k: RMSNorm

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q(q)[0], self.k(k)[0]

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """(q weight, k weight, eps, offset) as `kernels.apply_rotary` takes them."""
        return self.q.weight, self.k.weight, self.q.eps, self.q.offset
