"""Linear layers that can send decode-sized products to the skinny-GEMM kernel.

A decode step multiplies a few token rows by every weight matrix, so each product is
bound by reading the weight. `vlmbatch.kernels.skinny_linear` reads some of them faster
than cuBLAS on the H200 and others slower (`vlmbatch bench kernels --sections linear`,
BENCHMARKS.md), so each layer says up to how many rows it takes the kernel, and with
which launch shape. `VLMBATCH_DECODE_LINEAR` overrides: `auto` (those measured choices,
the default), `skinny` (every layer, up to the kernel's row limit) or `cublas` (none).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

CHOICES = ("auto", "skinny", "cublas")


def decode_linear_choice() -> str:
    choice = os.environ.get("VLMBATCH_DECODE_LINEAR", "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"VLMBATCH_DECODE_LINEAR={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


class Linear(nn.Linear):
    """`nn.Linear` whose inputs of at most `skinny_rows` rows go through the skinny-GEMM
    kernel once `use_kernel` has given it one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, skinny_rows: int = 0, skinny_launch: dict[str, int] | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.skinny_rows = skinny_rows
        self.skinny_launch = skinny_launch or {}
        self.skinny: Callable | None = None
        self.max_skinny_rows = 0

    def use_kernel(self, kernels: Any | None) -> None:
        """Take `kernels.skinny_linear` (or plain `F.linear` with None) as `VLMBATCH_DECODE_LINEAR` says."""
        choice = decode_linear_choice()
        if kernels is None or choice == "cublas" or (choice == "auto" and not self.skinny_rows):
            self.skinny, self.max_skinny_rows = None, 0
        elif choice == "auto":  # the measured rows and launch shape
            self.max_skinny_rows = self.skinny_rows
            self.skinny = functools.partial(kernels.skinny_linear, config=kernels.SkinnyConfig(**self.skinny_launch))
        else:  # every layer, up to the kernel's limit, default launch shape
            self.max_skinny_rows = kernels.skinny_gemm.MAX_ROWS
            self.skinny = kernels.skinny_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= self.max_skinny_rows:
            return self.skinny(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
