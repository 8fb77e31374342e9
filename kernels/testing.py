"""What the kernel tests and the GPU benchmark share: where kernels can run, tolerances, inputs.

Random paged-KV inputs are laid out as the engine lays them out: blocks are handed out in
a shuffled order so that every sequence's pages are scattered through the cache (as after
a long-running engine's frees), unused table entries are -1, and a few spare blocks hold
garbage that a correct kernel never reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.runtime.interpreter import InterpretedFunction

from .kv_cache_write import _store_kvcache_kernel

SPARE_BLOCKS = 3
GARBAGE = 1.0e4

# (atol, rtol) of a kernel against its float32-accumulating reference. Interpreted fp32 is
# exact up to summation order; fp16/bf16 lose a few ulps where P is rounded before P @ V.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


@dataclass(frozen=True)
class KernelTarget:
    """Where this process can run the kernels, and in which dtypes they can be checked there."""

    device: str
    dtypes: tuple[torch.dtype, ...]


def kernel_target() -> KernelTarget | None:
    """The Triton interpreter on the CPU (fp32/fp16: its bf16 `tl.dot` is wrong), else a CUDA GPU, else None.

    The interpreter is chosen when `@triton.jit` runs, i.e. when this package is imported
    with TRITON_INTERPRET=1 set, so ask the kernels themselves rather than the environment.
    """
    if isinstance(_store_kvcache_kernel, InterpretedFunction):
        return KernelTarget("cpu", (torch.float32, torch.float16))
    if torch.cuda.is_available():
        return KernelTarget("cuda", (torch.float16, torch.bfloat16))
    return None


@dataclass
class PagedKV:
    """A filled cache pair and the block tables that locate each sequence's tokens."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> PagedKV:
    """Caches `[num_blocks, block_size, kv_heads, head_dim]` with random keys/values for each sequence.

    Values are drawn on `device` itself: benchmark caches run to gigabytes.
    """
    generator = torch.Generator().manual_seed(seed)
    device_generator = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + SPARE_BLOCKS
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_seq, default=0) + 1  # one spare column that must stay unread
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=device_generator, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=device_generator, device=device, dtype=dtype)
    for spare in order[taken:]:
        k_cache[spare] = GARBAGE
        v_cache[spare] = GARBAGE
    return PagedKV(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def ptxas_spill_bytes(ptx: str) -> int:
    """Bytes of spill stores that ptxas (Triton's own) reports for `ptx` on sm_90a: a kernel
    that spills in its main loop loses most of its speed, and the CPU can tell (session 16:
    the w8a8 expert GEMMs)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(source), "-o", str(Path(folder) / "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))
