"""The gated MLP's activations in plain PyTorch (the fused Triton SiLU one is `vlmbatch.kernels.fused_silu_and_mul`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` [..., 2 * n] -> silu(gate) * up, [..., n]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU as Gemma computes it (`gelu_pytorch_tanh`): gelu(gate, tanh approximation) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
