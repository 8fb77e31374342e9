"""Runs the kernel tests under the Triton interpreter when this process cannot run them
(`interpreter_harness`: each file set in a subprocess started with the session)."""

from __future__ import annotations

import re

import pytest

from vlmbatch.kernels.testing import kernel_target

GPU_ONLY_SKIPS = ("needs a CUDA GPU", "the kernels are interpreted in this process", "this process runs the kernel tests directly")
SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", re.M)
needs_interpreter = pytest.mark.skipif(kernel_target() is not None, reason="this process runs the kernel tests directly")


@needs_interpreter
def test_kernels_pass_under_the_triton_interpreter(interpreted_kernel_runs):
    returncode, output = interpreted_kernel_runs["test_kernels_pass_under_the_triton_interpreter"].result()
    assert returncode == 0, output[-9000:]
    assert " passed" in output and "skipped" not in output, output[-3000:]


@needs_interpreter
def test_fp8_and_moe_kernels_pass_under_the_triton_interpreter_skipping_only_gpu_cases(interpreted_kernel_runs):
    run = interpreted_kernel_runs["test_fp8_and_moe_kernels_pass_under_the_triton_interpreter_skipping_only_gpu_cases"]
    returncode, output = run.result()
    assert returncode == 0, output[-9000:]
    assert " passed" in output, output[-3000:]
    reasons = SKIP_LINE.findall(output)
    assert reasons, "no skip reasons parsed: without CUDA the bf16 GPU cases must show up as skipped"
    unexpected = [reason for reason in reasons if not reason.startswith(GPU_ONLY_SKIPS)]
    assert not unexpected, unexpected
