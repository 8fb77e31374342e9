"""Qwen3-VL-MoE (30B-A3B, 235B-A22B) in the paged engine: Qwen3-VL with sparse MLP layers.

A layer is sparse exactly where transformers makes it one (not in `mlp_only_layers`, and
every `decoder_sparse_step`-th); its experts run on the fused grouped-GEMM kernels
alongside the triton backend, or on their torch reference (`engine/layers/moe.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from vlmbatch.engine.decoder import DecoderSpec, dense_mlp
from vlmbatch.engine.kernel_choice import KernelSet
from vlmbatch.engine.layers.moe import FusedMoE
from vlmbatch.families.qwen3_vl.model import Qwen3VLModel


def is_sparse(cfg: Any, layer: int) -> bool:
    return layer not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (layer + 1) % cfg.decoder_sparse_step == 0


def moe_or_dense(cfg: Any, layer: int, kernels: KernelSet) -> nn.Module:
    if not is_sparse(cfg, layer):
        return dense_mlp(cfg, layer, kernels)
    triton_kernels = importlib.import_module("vlmbatch.kernels") if kernels.name == "triton" else None
    # Built on "meta": loading adopts transformers' expert tensors instead of copying them, so
    # 30B-A3B's ~57 GB of experts never exist twice on the GPU.
    return FusedMoE.from_config(cfg, kernels=triton_kernels, device="meta")


class Qwen3VLMoeModel(Qwen3VLModel):
    @classmethod
    def decoder_spec(cls, text_config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(text_config, "attention_bias", False)), qk_norm=True, mlp=moe_or_dense)


ENGINE_MODEL = Qwen3VLMoeModel
