"""The paged KV cache: per layer one K and one V tensor, `[num_blocks, block_size, kv_heads, head_dim]`,
sized from what the GPU has left after the weights and the activation peak. The j-th layer
of every KV-cache group shares pair j (`kv_groups.py`), so a block id means the same
token slots in each and one block costs `layers_per_group` layers' KV."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmbatch.engine.kv_groups import KVLayout

ACTIVATION_RESERVE_BYTES = 4 << 30  # vision tower (a full step of images), graphs and sampling beyond the measured prefill peak
CPU_KV_CACHE_BYTES = 256 << 20  # default cache on the CPU, where free memory says little


def kv_block_bytes(decoder: nn.Module, layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * layout.layers_per_group * decoder.num_kv_heads * decoder.head_dim
    return per_token * block_size * dtype.itemsize


def allocate_kv_cache(decoder: nn.Module, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer its (K, V) pair; layers of different groups at one slot get the same tensors."""
    shape = (num_blocks, block_size, decoder.num_kv_heads, decoder.head_dim)
    pairs = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
             for _ in range(layout.layers_per_group)]
    return [pairs[slot] for slot in layout.layer_slots]


def kv_blocks_from_free_memory(device: torch.device, block_bytes: int, full_prefill: Callable[[], None], utilization: float) -> int:
    """Blocks that fit in `utilization` x device memory after the weights, the peak of
    `full_prefill` (a prefill of the whole per-step token budget, run now) and a reserve."""
    if device.type != "cuda":
        return max(1, CPU_KV_CACHE_BYTES // block_bytes)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    full_prefill()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    num_blocks = (int(total * utilization) - peak - ACTIVATION_RESERVE_BYTES) // block_bytes
    if num_blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)")
    return int(num_blocks)
