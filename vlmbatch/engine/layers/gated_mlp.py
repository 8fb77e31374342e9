"""The gated MLP, down(act(gate_up(x))): the decoder's and the Qwen2.5-VL tower's.

Where the down projection is FP8 and the activation runs on the Triton kernels, the
activation writes its product already quantized for it (`emit_fp8_for_down`): one pass
over the widest activation of the layer fewer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.fp8_linear import Fp8Activation, Fp8Linear


class GatedMLP(nn.Module):
    """`gate_up_proj` computes gate and up as one product (gate rows first); `activation`
    is "silu" or "gelu_tanh" (GeGLU)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, kernels: KernelSet, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        activations = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}
        if activation not in activations:
            raise ValueError(f"unsupported activation {activation!r}; the MLP has {', '.join(activations)}")
        self.act: Callable = activations[activation]
        self.gelu = activation == "gelu_tanh"
        self.triton_activation = kernels.name == "triton"
        self.act_fp8: Callable | None = None  # set by `emit_fp8_for_down`

    def emit_fp8_for_down(self) -> None:
        """Where the down projection is FP8 and the activation runs on the Triton kernels, the
        activation writes its product quantized for it (`Fp8Gemms.gated`)."""
        if isinstance(self.down_proj, Fp8Linear) and self.triton_activation:
            self.act_fp8 = self.down_proj.input_quantizer(self.down_proj.gemms.gated, gelu=self.gelu)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_fp8 is not None:
            return self.down_proj(Fp8Activation(*self.act_fp8(gate_up), gate_up.dtype))
        return self.down_proj(self.act(gate_up))
