"""Qwen3-VL-MoE's sparse block: a router and experts, on the fused grouped-GEMM kernels.

Routing is transformers' (`Qwen3VLMoeTextTopKRouter`): softmax in float32 over the router
logits, top-k, renormalised, cast back to the logits' dtype. The router and the experts
run as `vlmbatch.kernels.route_topk` and `fused_moe` (Triton) or as their pure-torch
forms, chosen once, from the `kernels` argument, when the block is built. The expert weights keep transformers'
layout, `gate_up` [experts, 2 * intermediate, hidden] (gate rows first) and `down`
[experts, hidden, intermediate]; the checkpoints store both transposed (transformers
transposes them when it loads), which `copy_experts(..., transposed=True)` takes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmbatch.kernels.reference import fused_moe_ref


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k], exactly as transformers routes: the
    softmax in float32, top-k, renormalised to sum 1, the weights cast to the logits' dtype."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class FusedMoE(nn.Module):
    """Router `gate` and the experts of one mixture-of-experts layer, over flat [tokens, hidden]."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
        kernels: Any | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ):  # fmt: skip
        """`kernels`: the `vlmbatch.kernels` module to run the experts as Triton kernels (a
        CUDA device, or the CPU under TRITON_INTERPRET=1), or None for the torch reference.
        Build on the "meta" device to let `set_experts` adopt transformers' tensors."""
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory).requires_grad_(False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory), requires_grad=False)
        self.route = kernels.route_topk if kernels is not None else select_experts
        self.run_experts = kernels.fused_moe if kernels is not None else fused_moe_ref
        self.fp8_scales: dict[str, torch.Tensor] = {}  # FP8 experts: the kernels' gate_up_scales / down_scales

    @classmethod
    def from_config(cls, text_config: Any, kernels: Any | None = None, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> FusedMoE:
        """From a `Qwen3VLMoeTextConfig` (or a Qwen3-MoE-style one). transformers'
        qwen3_vl_moe router always renormalises; its config has no `norm_topk_prob`."""
        return cls(
            text_config.hidden_size, text_config.moe_intermediate_size, text_config.num_experts, text_config.num_experts_per_tok,
            getattr(text_config, "norm_topk_prob", True), kernels=kernels, device=device, dtype=dtype,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.run_experts(x, self.gate_up, self.down, weights, ids, **self.fp8_scales)

    @property
    def takes_fp8(self) -> bool:
        """Whether the experts run on the Triton kernels, which take FP8 weights as they are."""
        return self.run_experts is not fused_moe_ref

    def use_fp8(self, gate_up: torch.Tensor, gate_up_scales: torch.Tensor, down: torch.Tensor, down_scales: torch.Tensor) -> None:
        """Hold the experts in FP8 (float8_e4m3fn, our layout) with float32 block scales
        [experts, blocks of rows (or rows), blocks of K]; the kernels dequantize per tile."""
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.fp8_scales = {"gate_up_scales": gate_up_scales.float().contiguous(), "down_scales": down_scales.float().contiguous()}

    @torch.no_grad()
    def load_from_hf(self, block: nn.Module) -> None:
        """Take the weights of a transformers `Qwen3VLMoeTextSparseMoeBlock` (see `set_experts`)."""
        gate_up = block.experts.gate_up_proj
        self.set_experts(gate_up, block.experts.down_proj, gate_up.device, gate_up.dtype)
        if self.gate.weight.is_meta:
            self.gate.weight = nn.Parameter(block.gate.weight.detach(), requires_grad=False)
        else:
            self.gate.weight.copy_(block.gate.weight)

    def load_weights(self, weights: Any, prefix: str) -> None:
        """The router and experts from a `weight_loading.WeightLoader` (`prefix`: the block's name)."""
        weights.experts(self, prefix)

    @torch.no_grad()
    def set_experts(self, gate_up: torch.Tensor, down: torch.Tensor, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> None:
        """Expert weights in transformers' layout, without two full copies of them: a block
        built on "meta" adopts the tensors when they are already what the kernels read
        (row-major, on `device` in `dtype`: shared storage), else gets new ones there that
        they are copied into one expert at a time; a materialised block copies them in."""
        if gate_up.shape != self.gate_up.shape or down.shape != self.down.shape:
            raise ValueError(f"expert weights {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit this block's {tuple(self.gate_up.shape)} / {tuple(self.down.shape)}")
        if self.gate_up.is_meta:
            device, dtype = torch.device(device or gate_up.device), dtype or gate_up.dtype
            on_device = (device.type, device.index) in ((gate_up.device.type, gate_up.device.index), (gate_up.device.type, None))
            if on_device and down.device == gate_up.device and all(t.is_contiguous() and t.dtype == dtype for t in (gate_up, down)):
                self.gate_up = nn.Parameter(gate_up.detach(), requires_grad=False)
                self.down = nn.Parameter(down.detach(), requires_grad=False)
                return
            self.gate_up = nn.Parameter(torch.empty(gate_up.shape, device=device, dtype=dtype), requires_grad=False)
            self.down = nn.Parameter(torch.empty(down.shape, device=device, dtype=dtype), requires_grad=False)
        self.copy_experts(gate_up, down)

    @torch.no_grad()
    def copy_experts(self, gate_up: torch.Tensor, down: torch.Tensor, transposed: bool = False) -> None:
        """Copy expert weights in, one expert at a time (so a conversion of dtype or device
        holds one expert's temporary, not a second copy of all). `transposed`: the
        checkpoint layout, gate_up [experts, hidden, 2 * I] and down [experts, I, hidden]."""
        for expert in range(self.gate_up.shape[0]):
            self.gate_up[expert].copy_(gate_up[expert].T if transposed else gate_up[expert])
            self.down[expert].copy_(down[expert].T if transposed else down[expert])
