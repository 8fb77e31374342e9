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
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache_ref(k[keep], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache_ref(v[keep], v_cache.dtype)


def to_cache_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as a KV cache of `cache_dtype` stores it: an FP8 cache clamps to +-448 (e4m3's
    range; torch's cast would give NaN past it), then rounds to nearest even."""
    if cache_dtype == torch.float8_e4m3fn:
        return x.clamp(-448.0, 448.0).to(cache_dtype)
    return x.to(cache_dtype)


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


def moe_gate_up_ref(hidden: torch.Tensor, w_gate_up: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SiLU(gate) * up of each token's k experts, `[tokens, k, intermediate]`, one expert at a
    time as transformers' `Qwen3VLMoeTextExperts` does: `w_gate_up` is `[experts, 2 * I, hidden]`
    with the gate rows first; the projection, the SiLU and the product are each rounded to
    the model dtype (`dtype`, default `hidden`'s: FP8 references pass float32 operands).
    Slots with ids outside [0, experts) stay zero."""
    dtype = dtype or hidden.dtype
    act = hidden.new_zeros(*topk_ids.shape, w_gate_up.shape[1] // 2, dtype=dtype)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = (hidden[token].float() @ w_gate_up[expert].float().T).to(dtype).chunk(2, dim=-1)
        act[token, slot] = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    return act


def moe_down_ref(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each slot's expert output times its routing weight, `[tokens, k, hidden]`, rounded once
    to `dtype` (default `act`'s; `w_down` is `[experts, hidden, I]`); unused slots stay zero."""
    dtype = dtype or act.dtype
    out = act.new_zeros(*topk_ids.shape, w_down.shape[1], dtype=dtype)
    for expert in range(w_down.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        product = act[token, slot].float() @ w_down[expert].float().T
        out[token, slot] = (product * topk_weights[token, slot, None].float()).to(dtype)
    return out


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' MoE routing (the softmax in float32, top-k, renormalised, the weights cast
    to the logits' dtype) with ties taken by the lower expert id, as `route_topk` takes
    them: a stable descending sort where `torch.topk` promises no order among equals."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


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


FP8_MAX = 448.0


def quantize_fp8_ref(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scales [rows, groups]) of `x` [rows, K]: each token's
    groups of `group` columns (None: the whole row) divided by amax / 448 (amax floored at
    1e-12), clamped to +-448 and rounded to nearest even by torch's cast."""
    rows, k = x.shape
    group = group or k
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, groups * group)[:, :k], scale


def quantize_fp8_blocks_ref(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales [ceil(N/block), ceil(K/block)]) of a weight
    [N, K]: each block x block tile scaled so its largest magnitude is 448, as block-wise
    FP8 checkpoints store it."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    tiles = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def expand_block_scales(scales: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-element float32 scales [N, K] of block scales [ceil(N / rows), ceil(K / cols)]."""
    n, k = shape
    return scales.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize_fp8_ref(w_q: torch.Tensor, w_s: torch.Tensor, group: int = 128) -> torch.Tensor:
    """float32 weight [N, K] of fp8 `w_q` and its scales: per channel ([N, 1]), block
    ([ceil(N/group), ceil(K/group)]) or per-row block ([N, ceil(K/group)])."""
    n, k = w_q.shape
    rows = 1 if w_s.shape[0] == n else group
    cols = k if w_s.shape[1] == 1 else group
    return w_q.float() * expand_block_scales(w_s, (n, k), (rows, cols))


def fp8_gemm_ref(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, group: int = 128) -> torch.Tensor:  # fmt: skip
    """What `fp8_gemm` computes: the dequantized activation times the dequantized weight in
    float32 (each group's scales applied to its float32 dot), plus bias, rounded once."""
    out = dequantize_fp8_ref(a_q, a_s, group) @ dequantize_fp8_ref(w_q, w_s, group).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def dequantize_experts_ref(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 expert weights [experts, N, K] times their block scales, in `dtype`."""
    return torch.stack([dequantize_fp8_ref(w[e], scales[e]) for e in range(w.shape[0])]).to(dtype)


def fp8_round_trip_ref(x: torch.Tensor) -> torch.Tensor:
    """float32 values of `x` [rows, K] quantized to e4m3 per row and 128 columns: what a w8a8 GEMM multiplies."""
    return dequantize_fp8_ref(*quantize_fp8_ref(x, 128))


def fused_moe_fp8_stages_ref(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gate_up_scales: torch.Tensor, down_scales: torch.Tensor, fp8_activations: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(act [tokens, k, intermediate], weighted down [tokens, k, hidden]) of `fused_moe_fp8_ref`:
    its two GEMMs' outputs, which the tile sweep checks one stage at a time."""
    if not fp8_activations:
        act = moe_gate_up_ref(hidden, dequantize_experts_ref(w_gate_up, gate_up_scales, hidden.dtype), topk_ids)
        return act, moe_down_ref(act, dequantize_experts_ref(w_down, down_scales, hidden.dtype), topk_weights, topk_ids)
    dtype = hidden.dtype
    act = moe_gate_up_ref(fp8_round_trip_ref(hidden), dequantize_experts_ref(w_gate_up, gate_up_scales, torch.float32), topk_ids, dtype)
    act_in = fp8_round_trip_ref(act.flatten(0, 1)).view(act.shape)  # rows are independent: unused slots stay zero
    return act, moe_down_ref(act_in, dequantize_experts_ref(w_down, down_scales, torch.float32), topk_weights, topk_ids, dtype)


def fused_moe_fp8_ref(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gate_up_scales: torch.Tensor, down_scales: torch.Tensor, fp8_activations: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`fused_moe_ref` on FP8 experts: each expert's weight dequantized (float32 product with
    its block scales) and rounded to the activations' dtype, which is what the per-pair
    kernels compute tile by tile and what the CPU path holds after dequantizing at load.
    `fp8_activations` (the grouped kernels, w8a8): each GEMM's input is quantized per token
    and 128 columns too, and both products run in float32 on the dequantized operands; the
    act between them is rounded to the activations' dtype, as the kernels store it."""
    _, per_pair = fused_moe_fp8_stages_ref(hidden, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scales, down_scales, fp8_activations)
    return per_pair.float().sum(dim=1).to(hidden.dtype)
