"""The paged decoder: Qwen2, Qwen3, Llama and Gemma 3-style layers over flat token batches.

Qwen2 (Qwen2-VL / Qwen2.5-VL's language model), Qwen3 (Qwen3-VL's), Llama (LLaVA-1.5's)
and Gemma 3 differ in q/k/v biases, per-head q/k RMSNorms, the norm itself (Gemma: (1 + w)
in fp32, and extra norms after attention and after the MLP), the activation (SiLU or
GeGLU), an embedding scale, per-layer attention (sliding window or global, each with its
own RoPE base), the attention scale, a final logit soft cap, the position scheme (M-RoPE
or 1-D RoPE) and the MLP (dense, or a mixture of experts), so one implementation serves
them: the family says which in a `DecoderSpec`, and nothing here names a family. Weights
are loaded by `transformers`' names, from its model of the same checkpoint or straight
from the checkpoint's files (`weight_loading.py`), into a decoder built on "meta", with
q/k/v and gate/up fused into one matmul each, layer by layer.

DeepStack (Qwen3-VL) adds a vision feature level to the hidden states at the media
positions after each of the first layers; a prefill step passes those rows as `DeepStack`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vlmbatch.engine.attention import AttentionBackend, AttentionMetadata
from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.embedding import ScaledEmbedding
from vlmbatch.engine.layers.gated_mlp import GatedMLP
from vlmbatch.engine.layers.linear import Linear
from vlmbatch.engine.layers.norm import HeadNorms, OffsetRMSNorm, RMSNorm
from vlmbatch.engine.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from vlmbatch.engine.weight_loading import WeightLoader

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
class LayerAttention:
    """How one layer attends: `window` > 0 is a sliding window (query q sees key k only when
    q - k < window, as `transformers`' sliding_window_overlay), 0 is global; `rope` names
    the decoder's rotary embedding the layer uses (Gemma 3: a local and a global base)."""

    window: int = 0
    rope: str = "default"


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the language models the decoder serves (see the module docstring)."""

    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before rotary
    mlp: Callable[[Any, int, KernelSet], nn.Module] | None = None  # (text config, layer, kernels) -> MLP; None = dense
    offset_norm: bool = False  # every RMSNorm applies (1 + w) in fp32 (`OffsetRMSNorm`)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma's four per layer)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    layers: tuple[LayerAttention, ...] | None = None  # per layer; None: every layer global with the "default" rope
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def layer(self, index: int) -> LayerAttention:
        return self.layers[index] if self.layers is not None else LayerAttention()

    def norm(self, size: int, eps: float, kernels: KernelSet) -> RMSNorm:
        return OffsetRMSNorm(size, eps, kernels.rms_norm) if self.offset_norm else RMSNorm(size, eps, kernels.rms_norm)


class Attention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, spec: DecoderSpec, kernels: KernelSet, layer: LayerAttention):
        super().__init__()
        hidden, num_heads, num_kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, skinny=kernels.skinny())
        self.o_proj = Linear(self.q_size, hidden, bias=False, skinny=kernels.skinny())
        self.q_norm = spec.norm(head_dim, cfg.rms_norm_eps, kernels) if spec.qk_norm else None
        self.k_norm = spec.norm(head_dim, cfg.rms_norm_eps, kernels) if spec.qk_norm else None
        self.head_norms = HeadNorms(self.q_norm, self.k_norm) if spec.qk_norm else None  # the backend may fuse them
        self.scale = spec.attention_scale if spec.attention_scale is not None else head_dim**-0.5
        self.window = layer.window
        self.rotary: Callable = kernels.rotary

    def load_weights(self, weights: WeightLoader, prefix: str) -> None:
        self.qkv_proj = weights.linear(self.qkv_proj, [f"{prefix}.{p}_proj" for p in "qkv"])
        self.o_proj = weights.linear(self.o_proj, [f"{prefix}.o_proj"])
        if self.q_norm is not None:
            weights.param(self.q_norm, "weight", f"{prefix}.q_norm.weight")
            weights.param(self.k_norm, "weight", f"{prefix}.k_norm.weight")

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        q, k = backend.rotate_and_store(q, k, v, cos, sin, k_cache, v_cache, meta, self.rotary, self.head_norms)
        if meta.is_prefill:
            out = backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        else:
            out = backend.decode(q, k_cache, v_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(GatedMLP):
    """The decoder's gated MLP: no biases, the skinny-GEMM kernel where it was measured faster."""

    def __init__(self, hidden: int, intermediate: int, kernels: KernelSet, activation: str = "silu"):
        super().__init__(Linear(hidden, 2 * intermediate, bias=False, skinny=kernels.skinny(SKINNY_ROWS, GATE_UP_LAUNCH)),
                         Linear(intermediate, hidden, bias=False, skinny=kernels.skinny()), kernels, activation)

    def load_weights(self, weights: WeightLoader, prefix: str) -> None:
        self.gate_up_proj = weights.linear(self.gate_up_proj, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = weights.linear(self.down_proj, [f"{prefix}.down_proj"])


def dense_mlp(cfg: Any, layer: int, kernels: KernelSet, activation: str = "silu") -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size, kernels, activation)


class DecoderLayer(nn.Module):
    """Pre-norm layer; with `sandwich_norms` (Gemma) `post_attention_layernorm` normalises
    the attention output before the residual add and `pre_feedforward_layernorm` /
    `post_feedforward_layernorm` wrap the MLP, as `transformers` names them."""

    def __init__(self, cfg: Any, layer: int, head_dim: int, spec: DecoderSpec, kernels: KernelSet):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = spec.norm(hidden, eps, kernels)
        self.self_attn = Attention(cfg, head_dim, spec, kernels, spec.layer(layer))
        self.post_attention_layernorm = spec.norm(hidden, eps, kernels)
        self.pre_feedforward_layernorm = spec.norm(hidden, eps, kernels) if spec.sandwich_norms else None
        self.post_feedforward_layernorm = spec.norm(hidden, eps, kernels) if spec.sandwich_norms else None
        self.mlp = spec.mlp(cfg, layer, kernels) if spec.mlp else dense_mlp(cfg, layer, kernels, spec.activation)

    def load_weights(self, weights: WeightLoader, prefix: str) -> None:
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            if getattr(self, name) is not None:
                weights.param(getattr(self, name), "weight", f"{prefix}.{name}.weight")
        self.self_attn.load_weights(weights, f"{prefix}.self_attn")
        self.mlp.load_weights(weights, f"{prefix}.mlp")

    def emit_fp8_inputs(self) -> None:
        """Each norm or activation whose only consumer is an FP8 projection writes that
        projection's input in FP8: one pass over the activations fewer per projection. The
        norm before a mixture of experts stays in the compute dtype (its router reads it too)."""
        self.input_layernorm.emit_fp8_for(self.self_attn.qkv_proj)
        if isinstance(self.mlp, GatedMLP):
            mlp_norm = self.pre_feedforward_layernorm if self.pre_feedforward_layernorm is not None else self.post_attention_layernorm
            mlp_norm.emit_fp8_for(self.mlp.gate_up_proj)
            self.mlp.emit_fp8_for_down()

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, backend)
        if self.pre_feedforward_layernorm is None:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h)[0], residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class Decoder(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head. `rotary` is one embedding,
    or several by name for layers that differ (`LayerAttention.rope`)."""

    def __init__(self, text_config: Any, rotary: RotaryEmbedding | dict[str, RotaryEmbedding], spec: DecoderSpec,
                 kernels: KernelSet):
        super().__init__()
        cfg = text_config
        if getattr(cfg, "hidden_act", "silu") != "silu" and spec.activation == "silu":
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.spec = spec
        self.embed_tokens = (ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, spec.embed_scale) if spec.embed_scale != 1.0
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.head_dim, spec, kernels) for i in range(cfg.num_hidden_layers))
        self.norm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, skinny=kernels.skinny(SKINNY_ROWS, LM_HEAD_LAUNCH))
        self.rotaries = rotary if isinstance(rotary, dict) else {"default": rotary}
        self.layer_ropes = [spec.layer(i).rope for i in range(cfg.num_hidden_layers)]
        if missing := set(self.layer_ropes) - set(self.rotaries):
            raise ValueError(f"layers use rotary embeddings {sorted(missing)} the decoder was not given")

    @torch.no_grad()
    def load_weights(self, weights: WeightLoader, tied: bool = False) -> None:
        """Every weight, from a decoder built on "meta", layer by layer (`weight_loading.py`:
        transformers' names, each source layer released once ours holds it). `tied`: the
        LM head is the token embedding where the source has no `lm_head.weight`."""
        weights.param(self.embed_tokens, "weight", "embed_tokens.weight")
        if isinstance(self.embed_tokens, ScaledEmbedding):
            self.embed_tokens.place_scale(weights.device, weights.dtype)
        weights.param(self.norm, "weight", "norm.weight")
        if not weights.param(self.lm_head, "weight", "lm_head.weight", required=not tied):
            self.lm_head.weight = self.embed_tokens.weight
        for i, layer in enumerate(self.layers):
            layer.load_weights(weights, f"layers.{i}")
            weights.source.release_layer(i)

    def emit_fp8_inputs(self) -> None:
        """After loading: FP8 projections take their inputs quantized by the kernels before them (`DecoderLayer.emit_fp8_inputs`)."""
        for layer in self.layers:
            layer.emit_fp8_inputs()

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metas: list[AttentionMetadata], backend: AttentionBackend, deepstack: DeepStack | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of a flat batch of tokens. `kv_caches` and
        `metas` per layer: a layer's KV-cache group has its own slots and block tables."""
        tables = {name: rotary(positions, inputs_embeds.dtype) for name, rotary in self.rotaries.items()}
        h, residual = inputs_embeds, None
        levels = deepstack.rows.shape[1] if deepstack is not None else 0
        for index, (layer, kv_cache, meta) in enumerate(zip(self.layers, kv_caches, metas)):
            cos, sin = tables[self.layer_ropes[index]]
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, backend)
            if index < levels:  # the layer's output in full, then the level added, as transformers adds it
                h = h + residual
                residual = None
                h[deepstack.positions] = h[deepstack.positions] + deepstack.rows[:, index]
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
