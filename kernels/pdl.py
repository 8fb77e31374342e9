"""Programmatic dependent launch (PDL): a kernel starts while the one before it drains.

Small-batch decode is a chain of about ten short, memory-bound kernels per layer, and each
pays a ramp (its first loads in flight) and a tail (its last programs finishing, the
memory flush) during which little is read. On Hopper and newer GPUs a kernel launched
with `launch_pdl=True` may start as soon as every program of the kernel before it has
called `gdc_launch_dependents`: it streams its weights into L2 (weights are never written
during decode) and then `gdc_wait`s for that kernel's results. CUDA graphs keep these
edges. Each kernel here calls `wait_for_previous` before its first read of an activation
and before its first store (the buffer it writes may be one the previous kernel still
reads), then `let_next_start`; so at most two kernels of the chain run at once.
`VLMBATCH_PDL=0` turns it off; the interpreter and older GPUs never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


def _triton_launches_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("VLMBATCH_PDL", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and _triton_launches_pdl()


def pdl_enabled(tensor: torch.Tensor) -> bool:
    """Whether kernels working on `tensor` launch with PDL (a Hopper-or-newer GPU, a
    Triton that can, and `VLMBATCH_PDL` not 0). Read once per device: `reset()` re-reads."""
    return tensor.is_cuda and _pdl_on(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def launch_options(enabled: bool) -> dict[str, bool]:
    """The keyword arguments of a launch: the kernel's `PDL` switch and Triton's launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}


def reset() -> None:
    """Forget the per-device decision (after changing `VLMBATCH_PDL`)."""
    _pdl_on.cache_clear()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """Allow the next kernel of the stream to launch (it waits for this one's results)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, nbytes):
    """Ask the copy engine to bring `nbytes` (a multiple of 16) at each 16-byte-aligned
    address of `ptrs` into L2 without waiting for it (Hopper's bulk prefetch)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
