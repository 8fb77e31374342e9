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
larger kernels want), so a launch uses it only when the engine asked for it up to a row
count (`pdl_max_rows`, bound into the kernels once when the model is built: 16 by
default, 0 with `VLMBATCH_PDL=0`) and the launch is being captured into a CUDA graph:
eager launches never use PDL.
"""

from __future__ import annotations

import functools

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
def device_supports_pdl(device_index: int) -> bool:
    """A Hopper-or-newer GPU and a Triton that launches with PDL (read once per device)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and _triton_launches_pdl()


def pdl_applies(rows: int, max_rows: int, capturing: bool, device_supported: bool) -> bool:
    """The rule: a launch of `rows` rows uses PDL when the engine enabled it up to `max_rows`
    rows, the launch is being captured into a CUDA graph, and the device supports it."""
    return 0 < rows <= max_rows and capturing and device_supported


def pdl_launch(tensor: torch.Tensor, max_rows: int) -> bool:
    """Whether a kernel over `tensor` (rows on dim 0) launches with PDL now (`pdl_applies`)."""
    if max_rows <= 0 or not tensor.is_cuda:
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return pdl_applies(tensor.shape[0], max_rows, torch.cuda.is_current_stream_capturing(), device_supports_pdl(index))


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
