"""Pure-torch definitions of what every kernel in this package computes.

These are the semantic contract (see docs/structures.md, "Paged-KV contract"): the
Triton kernels are tested against them, and the engine can fall back on them where
Triton cannot run. They favour clarity over speed: per-sequence Python loops,
float32 arithmetic, one rounding to the output dtype at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's k/v (`[num_tokens, kv_heads, head_dim]`) into flat slot `slot_mapping[i]`; -1 skips it."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_paged_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first `context_len` tokens of one sequence, `[context_len, kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_query_pos: int, softmax_scale: float,
    window: int = 0, key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA attention of queries at positions first_query_pos.. over keys 0..len(k)-1, in float32.

    Query q sees key k when k <= q (or k < key_ends[q], given) and, with a sliding
    `window`, when q - k < window."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * softmax_scale
    query_pos = first_query_pos + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(k.shape[0], device=q.device)
    ends = query_pos + 1 if key_ends is None else key_ends.to(query_pos.dtype)
    hidden = key_pos[None, :] >= ends[:, None]
    if window:
        hidden |= key_pos[None, :] <= query_pos[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence (`q[num_seqs, q_heads, head_dim]`) over its cached context
    (its last `window` tokens with a sliding window)."""
    out = torch.empty_like(q)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            out[seq] = 0
            continue
        k = gather_paged_kv(k_cache, block_tables[seq], context_len)
        v = gather_paged_kv(v_cache, block_tables[seq], context_len)
        out[seq] = _attend(q[seq : seq + 1], k, v, context_len - 1, softmax_scale, window)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    window: int = 0,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen attention: sequence b's q_len queries are its last q_len cached positions;
    causal, or up to `key_ends` [total_q] (bidirectional spans), within `window`."""
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if end == start:
            continue
        k = gather_paged_kv(k_cache, block_tables[seq], context_len)
        v = gather_paged_kv(v_cache, block_tables[seq], context_len)
        first_query_pos = context_len - (end - start)
        ends = None if key_ends is None else key_ends[start:end]
        out[start:end] = _attend(q[start:end], k, v, first_query_pos, softmax_scale, window, ends).to(q.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, offset: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Qwen2/Llama RMSNorm, rounding exactly where Hugging Face does; with `offset`, Gemma's
    (`Gemma3RMSNorm`: the weight applied as (1 + w) in fp32, rounded once at the end).

    With `residual`, first `x = x + residual` in the model dtype (the decoder layer's
    residual add) and return `(norm(x), x)` so the add and the norm share one pass.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (normed * (1.0 + weight.float())).to(x.dtype) if offset else weight * normed.to(x.dtype)
    return (out, x) if residual is not None else out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over `[tokens, heads, head_dim]`, in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated_half = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :].float() + rotated_half * sin[:, None, :].float()).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q `[tokens, q_heads, D]` and k `[tokens, kv_heads, D]`.

    cos/sin are `[tokens, D]`, already gathered per token (for M-RoPE, already
    interleaved by section), so one definition serves 1-D RoPE and M-RoPE.
    """
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def moe_gate_up_ref(hidden: torch.Tensor, w_gate_up: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of each token's k experts, `[tokens, k, intermediate]`, one expert at a
    time as transformers' `Qwen3VLMoeTextExperts` does: `w_gate_up` is `[experts, 2 * I, hidden]`
    with the gate rows first; the projection, the SiLU and the product are each rounded to
    the model dtype. Slots with ids outside [0, experts) stay zero."""
    dtype = hidden.dtype
    act = hidden.new_zeros(*topk_ids.shape, w_gate_up.shape[1] // 2)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = (hidden[token].float() @ w_gate_up[expert].float().T).to(dtype).chunk(2, dim=-1)
        act[token, slot] = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    return act


def moe_down_ref(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Each slot's expert output times its routing weight, `[tokens, k, hidden]`, rounded once
    (`w_down` is `[experts, hidden, I]`); unused slots stay zero."""
    out = act.new_zeros(*topk_ids.shape, w_down.shape[1])
    for expert in range(w_down.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        product = act[token, slot].float() @ w_down[expert].float().T
        out[token, slot] = (product * topk_weights[token, slot, None].float()).to(act.dtype)
    return out


def fused_moe_ref(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The experts of a Qwen3-VL-MoE sparse block for `hidden` `[tokens, hidden]` routed to
    `topk_ids` with `topk_weights` (both `[tokens, k]`): each token's weighted expert outputs
    added in float32 and rounded once. In float32 this is transformers' module up to the
    order of the additions; in bf16 it rounds the weighted product once where transformers
    rounds the product and then the weighting, and adds in float32 where it adds in bf16."""
    act = moe_gate_up_ref(hidden, w_gate_up, topk_ids)
    return moe_down_ref(act, w_down, topk_weights, topk_ids).float().sum(dim=1).to(hidden.dtype)
