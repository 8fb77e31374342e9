"""Runs the kernel tests under the Triton interpreter when this process cannot run them.

Whether a kernel is interpreted is fixed when `@triton.jit` runs, at import; in a full
`pytest tests/` run another module may import the kernels first, so the kernel tests get
a fresh interpreter of their own with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlmbatch.kernels.testing import kernel_target

KERNEL_TEST_FILES = ["test_kernels_attention.py", "test_kernels_elementwise.py"]
# These also hold bf16 GPU cases and sm_90 compile checks, which skip under the interpreter.
KERNEL_TEST_FILES_WITH_GPU_CASES = ["test_kernels_fp8.py", "test_kernels_moe.py"]
GPU_ONLY_SKIPS = ("needs a CUDA GPU", "the kernels are interpreted in this process", "this process runs the kernel tests directly")
SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", re.M)


def _run_interpreted(names: list[str]) -> subprocess.CompletedProcess:
    tests_dir = Path(__file__).parent
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *(str(tests_dir / n) for n in names)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=tests_dir.parent,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.skipif(kernel_target() is not None, reason="this process runs the kernel tests directly")
@pytest.mark.timeout(300)
def test_kernels_pass_under_the_triton_interpreter():
    result = _run_interpreted(KERNEL_TEST_FILES)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


@pytest.mark.skipif(kernel_target() is not None, reason="this process runs the kernel tests directly")
@pytest.mark.timeout(300)
def test_fp8_and_moe_kernels_pass_under_the_triton_interpreter_skipping_only_gpu_cases():
    result = _run_interpreted(KERNEL_TEST_FILES_WITH_GPU_CASES)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-3000:]
    reasons = SKIP_LINE.findall(result.stdout)
    assert reasons, "no skip reasons parsed: without CUDA the bf16 GPU cases must show up as skipped"
    unexpected = [reason for reason in reasons if not reason.startswith(GPU_ONLY_SKIPS)]
    assert not unexpected, unexpected
