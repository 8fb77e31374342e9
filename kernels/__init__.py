"""Triton kernels for the paged fast engine, each with a pure-torch reference (`*_ref`).

The references in `reference.py` define the semantics; the kernels are tested against them
on the CPU under `TRITON_INTERPRET=1` and on the GPU (`vlmbatch bench kernels`).
"""

from .decode_attention import DecodeConfig, choose_num_splits, paged_decode_attention
from .kv_cache_write import store_kvcache
from .prefill_attention import PrefillConfig, paged_prefill_attention
from .reference import (
    apply_rotary_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    store_kvcache_ref,
)
from .norm import rms_norm
from .pdl import launches_with_pdl
from .rotary import apply_rotary, apply_rotary_and_store
from .skinny_gemm import SkinnyConfig, skinny_linear

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "apply_rotary",
    "apply_rotary_and_store",
    "apply_rotary_ref",
    "launches_with_pdl",
    "choose_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "SkinnyConfig",
    "skinny_linear",
    "store_kvcache",
    "store_kvcache_ref",
]
