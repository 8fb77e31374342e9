"""Linear layers that can send decode-sized products to the skinny-GEMM kernel.

A decode step multiplies a few token rows by every weight matrix, so each product is
bound by reading the weight. `vlmbatch.kernels.skinny_linear` reads some of them faster
than cuBLAS on the H200 and others slower (`vlmbatch bench kernels --sections linear`,
BENCHMARKS.md), so each layer is built with its own choice (`KernelSet.skinny`): the
kernel and up to how many rows it takes, or none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.engine.kernel_choice import SkinnyLinear


class Linear(nn.Linear):
    """`nn.Linear` whose inputs of at most `skinny.max_rows` rows go through `skinny.kernel`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, skinny: SkinnyLinear | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.skinny = skinny

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= self.skinny.max_rows:
            return self.skinny.kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
