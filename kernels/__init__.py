"""Triton kernels for the paged fast engine, each with a pure-torch reference (`*_ref`).

The references in `reference.py` define the semantics; the kernels are tested against them
on the CPU under `TRITON_INTERPRET=1` and on the GPU (`vlmbatch bench kernels`).
"""

from .decode_attention import DecodeConfig, choose_num_splits, paged_decode_attention
from . import fp8
from .fp8 import Fp8GemmConfig, fp8_gemm, quantize_fp8
from .fused_moe import fused_moe
from .moe_tiles import GemmTile, MoeConfig
from .moe_routing import route_topk
from .kv_cache_write import store_kvcache
from .prefill_attention import PrefillConfig, choose_prefill_config, paged_prefill_attention
from .reference import (
    apply_rotary_ref,
    dequantize_fp8_ref,
    fp8_gemm_ref,
    fused_moe_ref,
    quantize_fp8_ref,
    route_topk_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    store_kvcache_ref,
)
from .norm import rms_norm, rms_norm_fp8
from .activation import fused_gelu_tanh_and_mul, fused_silu_and_mul, gated_fp8
from .rotary import apply_rotary, apply_rotary_and_store
from .skinny_gemm import SkinnyConfig, skinny_linear

__all__ = [
    "DecodeConfig",
    "Fp8GemmConfig",
    "GemmTile",
    "MoeConfig",
    "PrefillConfig",
    "apply_rotary",
    "apply_rotary_and_store",
    "apply_rotary_ref",
    "fused_gelu_tanh_and_mul",
    "fused_silu_and_mul",
    "gated_fp8",
    "choose_num_splits",
    "choose_prefill_config",
    "dequantize_fp8_ref",
    "fp8",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fused_moe",
    "fused_moe_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "quantize_fp8",
    "quantize_fp8_ref",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_ref",
    "route_topk",
    "route_topk_ref",
    "SkinnyConfig",
    "skinny_linear",
    "store_kvcache",
    "store_kvcache_ref",
]
