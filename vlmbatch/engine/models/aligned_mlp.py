"""Zero-pad gated MLPs whose intermediate size breaks 16-byte row alignment.

Qwen2.5-VL's vision tower has an intermediate size of 3420: rows of 3420 bf16 values are
not 16-byte aligned, so cuBLAS falls back to slow Ampere "align2" GEMM kernels on the
H200 (measured: the tower's MLP GEMMs ran at ~300 TFLOP/s, and the tower took more than
half of a W1 run). Padding gate/up with zero rows and down with zero columns changes
nothing in the result (silu(0) * 0 = 0, and zero columns add nothing) and lets the fast
kernels run.
"""

from __future__ import annotations

import torch
from torch import nn

ALIGNMENT = 64  # elements; 16 bytes would do, a multiple of the GEMM tile is kinder


def _padded_linear(linear: nn.Linear, out_features: int, in_features: int) -> nn.Linear:
    weight = linear.weight
    padded = nn.Linear(in_features, out_features, bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[: weight.shape[0], : weight.shape[1]] = weight
        if linear.bias is not None:
            padded.bias.zero_()
            padded.bias[: linear.bias.shape[0]] = linear.bias
    return padded.requires_grad_(linear.weight.requires_grad)


def align_gated_mlps(model: nn.Module) -> int:
    """Pad every gate/up/down MLP under `model` whose intermediate size is not a multiple
    of ALIGNMENT; returns how many were padded."""
    count = 0
    for module in model.modules():
        gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        if not all(isinstance(layer, nn.Linear) for layer in (gate, up, down)):
            continue
        size = gate.out_features
        if size % ALIGNMENT == 0:
            continue
        padded = -(-size // ALIGNMENT) * ALIGNMENT
        module.gate_proj = _padded_linear(gate, padded, gate.in_features)
        module.up_proj = _padded_linear(up, padded, up.in_features)
        module.down_proj = _padded_linear(down, down.out_features, padded)
        if hasattr(module, "intermediate_size"):
            module.intermediate_size = padded
        count += 1
    return count
