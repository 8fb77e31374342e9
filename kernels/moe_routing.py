"""Mixture-of-experts routing as transformers does it, in one launch: the softmax of the
router logits in float32, the top k, renormalised to sum 1, cast to the logits' dtype.

In PyTorch that is at least five kernels per MoE layer (softmax, top-k, sum, divide,
cast). A Qwen3-VL-30B-A3B decode step of one token is bound by its launches, not its
bytes (4.01 ms against a 1.44 ms roofline on the H200, BENCHMARKS.md session 13), and its
48 routers are 240 or more of them. One program routes one token: its row of logits fits in
registers (128 experts on 30B-A3B), and the k picks are k passes of max over that row.

Equal probabilities (equal bf16 logits) go to the lower expert id first; torch.topk does
not promise an order among ties, so the reference (`reference.route_topk_ref`) breaks
them the same way, and both pick the same set of experts whenever the tie does not
straddle the k-th place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import follow_previous, launch_options, pdl_launch


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    shifted = tl.exp(logits - tl.max(logits, 0))  # padding: exp(-inf) = 0
    probs = shifted / tl.sum(shifted, 0)
    remaining = tl.where(valid, probs, -1.0)  # below every probability: never picked
    slots = tl.arange(0, K_PAD)
    top_probs = tl.zeros([K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([K_PAD], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        pick = tl.min(tl.where(remaining == best, experts, E_PAD), 0)  # the lowest id among ties
        top_probs = tl.where(slots == slot, best, top_probs)
        top_ids = tl.where(slots == slot, pick, top_ids)
        remaining = tl.where(experts == pick, -1.0, remaining)
    if RENORMALIZE:
        top_probs = top_probs / tl.sum(tl.where(slots < TOP_K, top_probs, 0.0), 0)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, top_probs.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=slots < TOP_K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True,
               pdl_max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights [tokens, k] in the logits' dtype, expert ids [tokens, k] int64) of
    `router_logits` [tokens, experts], in descending order of weight: `reference.route_topk_ref`.
    Capturable in a CUDA graph (no host synchronisation)."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must lie in [1, {num_experts}] (the experts)")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 256 else 4, **launch_options(pdl_launch(logits, pdl_max_rows)),
        )  # fmt: skip
    return weights, ids
