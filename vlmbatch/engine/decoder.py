"""The paged decoder: Qwen2, Qwen3 and Llama-style layers over flat token batches.

Qwen2 (Qwen2-VL / Qwen2.5-VL's language model), Qwen3 (Qwen3-VL's) and Llama (LLaVA-1.5's)
differ in q/k/v biases, per-head q/k RMSNorms (Qwen3), the position scheme (M-RoPE or 1-D
RoPE) and the MLP (dense, or a mixture of experts), so one implementation serves them:
the family says which. Weights are taken from the `transformers` model of the same
checkpoint, with q/k/v and gate/up fused into one matmul each, layer by layer, dropping
each `transformers` layer once copied so the two copies never coexist whole.

DeepStack (Qwen3-VL) adds a vision feature level to the hidden states at the media
positions after each of the first layers; a prefill step passes those rows as `DeepStack`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlmbatch.engine.attention import AttentionBackend, AttentionMetadata
from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.linear import Linear
from vlmbatch.engine.layers.norm import RMSNorm
from vlmbatch.engine.layers.rotary import RotaryEmbedding

# Where the skinny-GEMM kernel beat cuBLAS on the H200 (`vlmbatch bench kernels --sections
# linear`, BENCHMARKS.md): the MLP's gate/up and the LM head, up to 16 rows, with these
# launch shapes (3B: 24.5 vs 26.0 us and 151 vs 161 us at one row; 7B: 70.6 vs 76.9 and
# 254 vs 269). q/k/v, o and down stay on cuBLAS, which the kernel did not beat.
SKINNY_ROWS = 16
GATE_UP_LAUNCH = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
LM_HEAD_LAUNCH = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5}


@dataclass
class DeepStack:
    """Vision features added after the first layers: `rows[:, i]` [tokens, hidden] is added
    at flat batch positions `positions` after layer i."""

    positions: torch.Tensor
    rows: torch.Tensor  # [tokens, levels, hidden]


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the language models the decoder serves."""

    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    mlp: Callable[[Any, int, KernelSet], nn.Module] | None = None  # (text config, layer, kernels) -> MLP; None = dense


class Attention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, spec: DecoderSpec, kernels: KernelSet):
        super().__init__()
        hidden, num_heads, num_kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, skinny=kernels.skinny())
        self.o_proj = Linear(self.q_size, hidden, bias=False, skinny=kernels.skinny())
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, kernels.rms_norm) if spec.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, kernels.rms_norm) if spec.qk_norm else None
        self.scale = head_dim**-0.5
        self.rotary: Callable = kernels.rotary

    @torch.no_grad()
    def load_from_hf(self, theirs: nn.Module) -> None:
        self.qkv_proj.weight.copy_(torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.copy_(torch.cat([theirs.q_proj.bias, theirs.k_proj.bias, theirs.v_proj.bias]))
        self.o_proj.weight.copy_(theirs.o_proj.weight)
        if self.q_norm is not None:
            self.q_norm.weight.copy_(theirs.q_norm.weight)
            self.k_norm.weight.copy_(theirs.k_norm.weight)

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        k_cache, v_cache = kv_cache
        q, k = backend.rotate_and_store(q, k, v, cos, sin, k_cache, v_cache, meta, self.rotary)
        if meta.is_prefill:
            out = backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            out = backend.decode(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, kernels: KernelSet):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, skinny=kernels.skinny(SKINNY_ROWS, GATE_UP_LAUNCH))
        self.down_proj = Linear(intermediate, hidden, bias=False, skinny=kernels.skinny())
        self.act: Callable = kernels.silu_and_mul

    @torch.no_grad()
    def load_from_hf(self, theirs: nn.Module) -> None:
        self.gate_up_proj.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        self.down_proj.weight.copy_(theirs.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def dense_mlp(cfg: Any, layer: int, kernels: KernelSet) -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size, kernels)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer: int, head_dim: int, spec: DecoderSpec, kernels: KernelSet):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.self_attn = Attention(cfg, head_dim, spec, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.mlp = (spec.mlp or dense_mlp)(cfg, layer, kernels)

    @torch.no_grad()
    def load_from_hf(self, theirs: nn.Module) -> None:
        self.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
        self.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
        self.self_attn.load_from_hf(theirs.self_attn)
        self.mlp.load_from_hf(theirs.mlp)

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head."""

    def __init__(self, text_config: Any, rotary: RotaryEmbedding, spec: DecoderSpec, kernels: KernelSet):
        super().__init__()
        cfg = text_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.head_dim, spec, kernels) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, skinny=kernels.skinny(SKINNY_ROWS, LM_HEAD_LAUNCH))
        self.rotary = rotary

    @torch.no_grad()
    def load_from_hf(self, language_model: nn.Module, lm_head: nn.Module) -> None:
        """Copy weights from a `transformers` text model, releasing each of its layers once copied."""
        self.embed_tokens.weight.copy_(language_model.embed_tokens.weight)
        self.norm.weight.copy_(language_model.norm.weight)
        self.lm_head.weight.copy_(lm_head.weight)
        for i, ours in enumerate(self.layers):
            ours.load_from_hf(language_model.layers[i])
            language_model.layers[i] = nn.Identity()

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend, deepstack: DeepStack | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of a flat batch of tokens."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h, residual = inputs_embeds, None
        levels = deepstack.rows.shape[1] if deepstack is not None else 0
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, backend)
            if index < levels:  # the layer's output in full, then the level added, as transformers adds it
                h = h + residual
                residual = None
                h[deepstack.positions] = h[deepstack.positions] + deepstack.rows[:, index]
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
