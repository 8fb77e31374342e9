"""Kernels compiled for Hopper (sm_90) on the CPU, where the interpreter cannot vouch for
them: it lets a kernel read any module global, compiled code only constexpr ones."""

from __future__ import annotations

import pytest

from vlmbatch.kernels.testing import kernel_target

TARGET = kernel_target()


@pytest.mark.skipif(TARGET is not None and TARGET.device == "cpu", reason="the kernels are interpreted in this process")
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_compiles_for_hopper(gelu):
    """The interpreter lets a kernel read any module global; compiled code may read only
    constexpr ones (Gemma 3's GeGLU constants stopped the 12B bench on the H200 so). Compile
    both activations for sm_90 here, where no GPU is needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vlmbatch.kernels.activation import _BLOCK, _gated_kernel

    args = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "stride_in": "i32", "stride_out": "i32"}
    constants = {"BLOCK": _BLOCK, "GELU": gelu, "PDL": False}
    source = ASTSource(_gated_kernel, {**args, **dict.fromkeys(constants, "constexpr")}, constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
    assert ".entry _gated_kernel" in ptx
