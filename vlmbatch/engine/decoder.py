"""A Qwen2/Llama-style decoder over flat token batches and the paged KV cache.

Qwen2 (the Qwen2-VL / Qwen2.5-VL language model) and Llama (LLaVA-1.5's) differ only in
q/k/v biases and the position scheme (M-RoPE vs 1-D RoPE), so one implementation serves
both. Weights are taken from the `transformers` model of the same checkpoint, with q/k/v
and gate/up fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable

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


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, kernels: KernelSet):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias, skinny=kernels.skinny())
        self.o_proj = Linear(self.q_size, hidden, bias=False, skinny=kernels.skinny())
        self.scale = head_dim**-0.5
        self.rotary: Callable = kernels.rotary

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim: int, bias: bool, kernels: KernelSet):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, bias, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, kernels)

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head."""

    def __init__(self, text_config, rotary: RotaryEmbedding, bias: bool, kernels: KernelSet):
        super().__init__()
        cfg = text_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.head_dim, bias, kernels) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, skinny=kernels.skinny(SKINNY_ROWS, LM_HEAD_LAUNCH))
        self.rotary = rotary

    @torch.no_grad()
    def load_from_hf(self, language_model: nn.Module, lm_head: nn.Module) -> None:
        """Copy weights from a `transformers` Qwen2/Llama text model (fusing q/k/v and gate/up)."""
        self.embed_tokens.weight.copy_(language_model.embed_tokens.weight)
        self.norm.weight.copy_(language_model.norm.weight)
        self.lm_head.weight.copy_(lm_head.weight)
        for ours, theirs in zip(self.layers, language_model.layers):
            a, m = theirs.self_attn, theirs.mlp
            ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            ours.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
            ours.self_attn.qkv_proj.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            if ours.self_attn.qkv_proj.bias is not None:
                ours.self_attn.qkv_proj.bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            ours.self_attn.o_proj.weight.copy_(a.o_proj.weight)
            ours.mlp.gate_up_proj.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            ours.mlp.down_proj.weight.copy_(m.down_proj.weight)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of a flat batch of tokens."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        h, residual = inputs_embeds, None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, backend)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
