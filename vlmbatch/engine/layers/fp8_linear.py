"""FP8 linear layers: e4m3 weights with their scales, activations quantized as the step runs.

A layer holds `weight` (float8_e4m3fn [N, K]) and `weight_scale` (float32): [N, 1] per
output channel (compressed-tensors checkpoints, online quantization) or
[ceil(N/128), ceil(K/128)] per 128x128 block (block-wise checkpoints; [N, ceil(K/128)]
when fused projections are not multiples of 128 rows, as in the tiny test models). Each
call quantizes its input per token (channel layout) or per token and 128 columns (block
layout), then multiplies: above `KernelSet.fp8.triton_max_rows` rows (64) through
`torch._scaled_mm` where cuBLAS takes the shape, else through `vlmbatch.kernels.fp8_gemm`
(with `fp8.decode_plan`'s launch at decode sizes), after `vlmbatch.kernels.quantize_fp8`. Nothing syncs with the host, so decode graphs
capture it. Where the input comes straight from a norm or the gated activation, that
kernel quantizes it instead (`Fp8Activation`, `input_quantizer`): one pass over the
activations fewer per projection.

Where FP8 cannot run (the CPU) the engine never builds these: `fp8_weights` gives the
same fp8 values and scales, and `dequantize` turns them into the compute-dtype weight of a
plain `Linear`, so both paths start from the same quantized weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import Fp8Gemms
from vlmbatch.kernels.reference import dequantize_fp8_ref, quantize_fp8_blocks_ref, quantize_fp8_ref

GROUP = 128  # block-wise checkpoints: 128x128 weight blocks, 1x128 activation groups


@dataclass(frozen=True)
class Fp8Activation:
    """A projection's input already quantized by the kernel that produced it, in the
    layout the projection takes (`Fp8Linear.input_quantizer`)."""

    q: torch.Tensor  # float8_e4m3fn [M, K]
    scale: torch.Tensor  # float32 [M, groups]
    dtype: torch.dtype  # the compute dtype of the projection's output


class Fp8Linear(nn.Module):
    """`x @ dequant(weight).T + bias` with dynamically quantized activations."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Linear takes a float8_e4m3fn weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.per_channel = weight_scale.shape == (self.out_features, 1)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.gemms = gemms
        self.use_scaled_mm = self.per_channel and gemms.scaled_mm_shapes(self.out_features, self.in_features)

    @property
    def activation_group(self) -> int | None:
        """Columns per activation scale: None (one per token) for per-channel weights, 128 for blocks."""
        return None if self.per_channel else GROUP

    def input_quantizer(self, fused_kernel: Callable, **options) -> Callable:
        """`fused_kernel` (one of `Fp8Gemms`' producers: `rms_norm`, `gated`) bound to this
        layer's activation layout, for the module that produces this layer's input."""
        return functools.partial(fused_kernel, group=self.activation_group, **options)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            leading, q, s, dtype = x.q.shape[:-1], x.q, x.scale, x.dtype
        else:
            leading, dtype = x.shape[:-1], x.dtype
            q, s = self.gemms.quantize(x.reshape(-1, self.in_features), self.activation_group)
        if self.use_scaled_mm and q.shape[0] > self.gemms.triton_max_rows:
            out = self.gemms.scaled_mm(q, s, self.weight, self.weight_scale, self.bias, out_dtype=dtype)
        else:  # Triton: `fp8.decode_plan`'s launch at decode sizes
            out = self.gemms.gemm(q, s, self.weight, self.weight_scale, self.bias, out_dtype=dtype)
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        layout = "per-channel" if self.per_channel else f"{GROUP}x{GROUP} blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {layout}"


def quantize_online(weight: torch.Tensor, blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization of a compute-dtype weight: fp8 [N, K] and float32 scales, [N, 1]
    per channel or [ceil(N/128), ceil(K/128)] in blocks."""
    return quantize_fp8_blocks_ref(weight, GROUP) if blocks else quantize_fp8_ref(weight, None)


def fuse(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One (fp8 weight, scales) of projections stacked by output rows (q/k/v, gate/up).
    Block scales stack as they are when every part's rows are a multiple of 128 (the
    released models), else each part's block rows are repeated per row ([N, K blocks])."""
    weights = torch.cat([w for w, _ in parts])
    scales = [s for _, s in parts]
    per_row = all(s.shape[0] == w.shape[0] for w, s in parts)  # per channel, or per-row blocks
    if per_row or all(w.shape[0] % GROUP == 0 for w, _ in parts):
        return weights, torch.cat(scales)
    return weights, torch.cat([s.float().repeat_interleave(GROUP, 0)[: w.shape[0]] for w, s in parts])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The compute-dtype weight of fp8 values and their scales (float32 products, one rounding)."""
    return dequantize_fp8_ref(weight, scale.float(), GROUP).to(dtype)
