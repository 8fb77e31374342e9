"""Programmatic dependent launch (PDL): a kernel starts while the one before it drains.

Small-batch decode is a chain of about ten short, memory-bound kernels per layer, each
paying a ramp (its first loads in flight) and a tail (its last programs finishing, the
memory flush). On Hopper and newer GPUs a kernel launched with `launch_pdl=True` may
start once every program of the kernel before it has called `gdc_launch_dependents`, and
`gdc_wait`s for that kernel's results; CUDA graphs keep these edges. Each kernel here
calls `follow_previous` before its first load and store (the buffer it writes may be
one the previous kernel still reads): it waits, then lets the next kernel launch, so at
most two kernels of the chain are resident at once.

Measured on the H200 (BENCHMARKS.md) it shortens a batch-1 decode step of the 3B shapes
by ~3% and lengthens a batch-64 one by 3-5% (the waiting programs hold SM slots the
larger kernels want), so kernels launch this way only inside `launches_with_pdl(True)`:
the engine's capture of small decode batches. `VLMBATCH_PDL=0` turns it off everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

_in_scope = False


def _triton_launches_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def device_supports_pdl(device_index: int) -> bool:
    """A Hopper-or-newer GPU, a Triton that launches with PDL, and `VLMBATCH_PDL` not 0
    (read once per device)."""
    if os.environ.get("VLMBATCH_PDL", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and _triton_launches_pdl()


@contextlib.contextmanager
def launches_with_pdl(enabled: bool = True) -> Iterator[None]:
    """Within this block (on a device that supports it) the kernels launch with PDL."""
    global _in_scope
    previous, _in_scope = _in_scope, enabled
    try:
        yield
    finally:
        _in_scope = previous


def pdl_enabled(tensor: torch.Tensor) -> bool:
    """Whether a kernel working on `tensor` launches with PDL now."""
    return _in_scope and tensor.is_cuda and device_supports_pdl(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def launch_options(enabled: bool) -> dict[str, bool]:
    """The keyword arguments of a launch: the kernel's `PDL` switch and Triton's launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}


@triton.jit
def follow_previous(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then
    let the next kernel of the stream launch (it waits in turn for this one's results).
    Call first, before any load or store."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
