"""Attention backends over the paged KV cache.

Every backend follows the paged-KV contract shared with `vlmbatch.kernels`: per layer a
`[num_blocks, block_size, num_kv_heads, head_dim]` K and V cache, `slot_mapping` for the
tokens written this step, `block_tables` / `context_lens` per sequence, and causal
prefill with an offset (query i of a sequence with q_len queries sits at position
context_len - q_len + i). Two refinements, both off by default: a layer's sliding
`window` (query q sees key k only when q - k < window) and, in prefill, per-query
`key_ends` (query q sees keys k < key_ends[q] instead of k <= q: the bidirectional spans
of Gemma 3's images, where an image token also sees the later tokens of its image; the
window still bounds from below). The runner never emits slot -1: padding rows of a CUDA graph
write into a spare block instead, so every backend can store with one scatter.

* `torch`: plain PyTorch (gather + SDPA); runs anywhere, the CPU parity tests use it.
* `triton`: our kernels in `vlmbatch.kernels` (lazy import: they need a GPU or
  `TRITON_INTERPRET=1`).
* `flash-attn`: FlashAttention's paged API when installed: FlashAttention-4
  (`flash_attn.cute`, the `flash-attn-4` wheel, CuTe DSL) or FlashAttention-2/3
  (`flash_attn`).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vlmbatch.kernels.reference import to_cache_ref

if TYPE_CHECKING:
    from vlmbatch.engine.layers.norm import HeadNorms


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Tensors live on the model's device; `q_lens` / `context_lens_host` are host copies for
    backends that loop over sequences (known when the batch is built, so no sync).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor  # int32 [num_seqs], cached + new tokens
    cu_seqlens_q: torch.Tensor | None = None  # int32 [num_seqs + 1], prefill only
    cu_seqlens_k: torch.Tensor | None = None  # int32 [num_seqs + 1], prefill only
    max_q_len: int = 1
    max_context_len: int = 1
    q_lens: list[int] | None = None
    context_lens_host: list[int] | None = None
    # int32 [num_tokens], prefill only: query i sees keys < key_ends[i] (at least its own
    # position + 1); None = causal. Set only when a chunk holds a bidirectional span.
    key_ends: torch.Tensor | None = None
    # Prefill only: the first sequences compute one token each (decoding sequences riding
    # along with prompt chunks; the scheduler puts them first). Backends run them as one
    # decode batch: through a prefill kernel, each would fill a whole query tile per head
    # and re-read its context once per query head (Qwen3-VL-8B's W1 on the H200: 63.8 req/s
    # that way, 67.1 as a decode batch). 0 = no such rows.
    num_decode_rows: int = 0

    def decode_rows(self) -> AttentionMetadata:
        """The metadata of the first `num_decode_rows` sequences as a decode step."""
        rows = slice(0, self.num_decode_rows)
        return AttentionMetadata(False, self.slot_mapping, self.block_tables[rows], self.context_lens[rows])


class AttentionBackend(ABC):
    name: str
    # Sliding windows and per-query key ends (bidirectional spans); a model that needs them
    # is refused on a backend without them when the runner is built (`ModelRunner`).
    beyond_causal = True

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write this step's keys/values [num_tokens, kv_heads, head_dim] into their slots."""
        for cache, values in ((k_cache, k), (v_cache, v)):
            values = to_cache_ref(values, cache.dtype)
            if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
                cache, values = cache.view(torch.uint8), values.view(torch.uint8)
            cache.view(-1, *values.shape[1:]).index_copy_(0, meta.slot_mapping, values)

    def rotate_and_store(self, q, k, v, cos, sin, k_cache, v_cache, meta: AttentionMetadata, rotary,
                         head_norms: HeadNorms | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise each head of q and k with `head_norms` (if any), rotate them with
        `rotary`, store the rotated k and v; returns (q, k) rotated."""
        if head_norms is not None:
            q, k = head_norms(q, k)
        q, k = rotary(q, k, cos, sin)
        self.store_kv(k, v, k_cache, v_cache, meta)
        return q, k

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """q [total_q, heads, dim] -> out, same shape; this step's k/v are already stored."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int = 0) -> torch.Tensor:
        """q [num_seqs, heads, dim] -> out, same shape. Must be CUDA-graph capturable."""


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as [length, kv_heads, dim], in
    `dtype` (an FP8 cache is read back in the compute dtype)."""
    return cache[block_ids.long()].flatten(0, 1)[:length].to(dtype)


def visible_keys(first_pos: int, q_len: int, ctx: int, window: int, key_ends: torch.Tensor | None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Bool [q_len, ctx]: which keys each of `q_len` queries at positions first_pos.. sees
    (causal, or up to `key_ends`; not below q - window + 1 when `window`)."""
    device = key_ends.device if key_ends is not None else device
    query = torch.arange(first_pos, first_pos + q_len, device=device).unsqueeze(1)
    key = torch.arange(ctx, device=device).unsqueeze(0)
    ends = query + 1 if key_ends is None else key_ends.to(query.dtype).unsqueeze(1)
    mask = key < ends
    if window:
        mask &= key > query - window
    return mask


class TorchBackend(AttentionBackend):
    """Gather the paged KV and call SDPA (fused kernels on GPU, the math kernel on CPU)."""

    name = "torch"

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, window=0):
        """SDPA per prompt chunk; the leading one-token rows (`num_decode_rows`) through the
        batched decode path in one call."""
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        decode_rows = meta.num_decode_rows
        if decode_rows:
            out[:decode_rows] = self.decode(q[:decode_rows], k_cache, v_cache, meta.decode_rows(), scale, window)
        starts = [0]
        for q_len in meta.q_lens:
            starts.append(starts[-1] + q_len)
        for b, (q_len, ctx) in enumerate(zip(meta.q_lens, meta.context_lens_host)):
            if b < decode_rows:
                continue
            start, end = starts[b], starts[b + 1]
            plain = window == 0 and meta.key_ends is None
            if ctx == q_len:  # nothing cached before: this step's k/v are the whole context
                keys, values = k[start:end], v[start:end]
            else:
                blocks = meta.block_tables[b, : (ctx + block_size - 1) // block_size]
                keys, values = _gather_context(k_cache, blocks, ctx, q.dtype), _gather_context(v_cache, blocks, ctx, q.dtype)
            causal = plain and ctx == q_len
            ends = None if meta.key_ends is None else meta.key_ends[start:end]
            mask = None if causal else visible_keys(ctx - q_len, q_len, ctx, window, ends, q.device)
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
        return out

    def decode(self, q, k_cache, v_cache, meta, scale, window=0):
        num_seqs, max_blocks = meta.block_tables.shape
        blocks = meta.block_tables.clamp(min=0).long()
        keys = k_cache[blocks].flatten(1, 2).to(q.dtype)  # [num_seqs, max_blocks * block_size, kv_heads, dim]
        values = v_cache[blocks].flatten(1, 2).to(q.dtype)
        positions = torch.arange(keys.shape[1], device=q.device).unsqueeze(0)
        lens = meta.context_lens.unsqueeze(1)
        mask = positions < lens
        if window:
            mask &= positions >= lens - window
        mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)


class TritonBackend(AttentionBackend):
    """Our Triton kernels (split-KV decode, varlen paged prefill); `pdl_max_rows` as the
    model's other kernels were built with (`KernelSet.pdl_max_rows`)."""

    name = "triton"

    def __init__(self, pdl_max_rows: int = 0) -> None:
        self.kernels = importlib.import_module("vlmbatch.kernels")
        self.pdl_max_rows = pdl_max_rows

    def store_kv(self, k, v, k_cache, v_cache, meta):
        self.kernels.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def rotate_and_store(self, q, k, v, cos, sin, k_cache, v_cache, meta, rotary, head_norms=None):
        """One kernel for the head norms, rotary and the store (the decoder's rotary is this backend's fused one)."""
        return self.kernels.apply_rotary_and_store(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                                   pdl_max_rows=self.pdl_max_rows,
                                                   head_norms=head_norms.fused_weights() if head_norms is not None else None)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, window=0):
        """The prefill kernel over the prompt chunks (it indexes tokens through cu_seqlens_q,
        so the sequences' slices suffice), the decode kernel over the leading one-token rows."""
        rows = meta.num_decode_rows
        if rows == len(meta.q_lens):
            out = torch.empty_like(q)
        else:
            out = self.kernels.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables[rows:], meta.cu_seqlens_q[rows:], meta.context_lens[rows:],
                meta.max_q_len, scale, window=window, key_ends=meta.key_ends,
            )
        if rows:
            out[:rows] = self.decode(q[:rows], k_cache, v_cache, meta.decode_rows(), scale, window)
        return out

    def decode(self, q, k_cache, v_cache, meta, scale, window=0):
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                   pdl_max_rows=self.pdl_max_rows, window=window)


def flash_attn_flavour() -> str | None:
    """Which FlashAttention API is importable: "fa4" (`flash_attn.cute`), "fa2" (the
    `flash_attn` package's own functions) or None. The FA4 wheel installs `flash_attn` as
    a namespace holding only `cute`, so finding `flash_attn` alone proves nothing."""
    try:
        if importlib.util.find_spec("flash_attn.cute") is not None:
            return "fa4"
        spec = importlib.util.find_spec("flash_attn")
    except ImportError:
        return None
    return "fa2" if spec is not None and spec.origin not in (None, "namespace") else None


class FlashAttnBackend(AttentionBackend):
    """FlashAttention over the paged cache: FlashAttention-4 (`flash_attn.cute`) when
    installed, else FlashAttention-2/3 (`flash_attn`, which needs block_size % 256 == 0).
    Causal masks align to the bottom right, the same offset the paged contract uses."""

    name = "flash-attn"
    # FlashAttention has sliding windows but no per-query key ends, and neither is wired up
    # or measured here: such models are refused rather than computed wrong.
    beyond_causal = False

    def __init__(self) -> None:
        self.flavour = flash_attn_flavour()
        if self.flavour is None:
            raise ImportError("the flash-attn backend needs `flash_attn.cute` (pip install flash-attn-4) or `flash_attn`")
        self.flash_attn = importlib.import_module("flash_attn.cute" if self.flavour == "fa4" else "flash_attn")

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale, window=0):
        if self.flavour == "fa4":
            return self.flash_attn.flash_attn_varlen_func(
                q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_q_len,
                max_seqlen_k=meta.max_context_len, seqused_k=meta.context_lens, page_table=meta.block_tables,
                softmax_scale=scale, causal=True,
            )[0]
        return self.flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_q_len, max_seqlen_k=meta.max_context_len, softmax_scale=scale,
            causal=True, block_table=meta.block_tables,
        )

    def decode(self, q, k_cache, v_cache, meta, scale, window=0):
        if self.flavour == "fa4":  # one query per sequence: the batched (not varlen) layout
            return self.flash_attn.flash_attn_varlen_func(
                q.unsqueeze(1), k_cache, v_cache, seqused_k=meta.context_lens, page_table=meta.block_tables,
                softmax_scale=scale, causal=True,
            )[0].squeeze(1)
        return self.flash_attn.flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens, block_table=meta.block_tables,
            softmax_scale=scale, causal=True,
        ).squeeze(1)


BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (TorchBackend, TritonBackend, FlashAttnBackend)}


def resolve_backend(name: str, device: torch.device) -> tuple[str, str]:
    """The backend `name` stands for on `device`, and why (for the start-up log). `auto` is a
    fixed rule from measurements, not a file a benchmark wrote: on the H200 our Triton
    kernels beat FlashAttention-4 at batch 64 (4.07 vs 6.21 ms a decode step, BENCHMARKS.md
    session 3) and SDPA over gathered KV everywhere, so CUDA takes triton when it imports;
    the CPU takes torch."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose auto or one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name, "chosen by --attention-backend / VLMBATCH_ATTENTION_BACKEND"
    if device.type != "cuda":
        return "torch", "auto: the only backend on the CPU"
    if importlib.util.find_spec("triton") is not None:
        return "triton", "auto: fastest measured on the H200 (BENCHMARKS.md); --attention-backend overrides"
    return "torch", "auto: triton is not installed"


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device` (the benchmark checks each)."""
    if device.type != "cuda":
        return ["torch"]
    names = ["triton"] if importlib.util.find_spec("triton") is not None else []
    return names + (["flash-attn"] if flash_attn_flavour() is not None else []) + ["torch"]


def create_backend(name: str, pdl_max_rows: int = 0) -> AttentionBackend:
    """Backend `name` (already resolved: not `auto`)."""
    if name == "triton":
        return TritonBackend(pdl_max_rows)
    return BACKENDS[name]()
