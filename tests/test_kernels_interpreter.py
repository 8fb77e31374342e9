"""Runs the kernel tests under the Triton interpreter when this process cannot run them.

Whether a kernel is interpreted is fixed when `@triton.jit` runs, at import; in a full
`pytest tests/` run another module may import the kernels first, so the kernel tests get
a fresh interpreter of their own with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmbatch.kernels.testing import kernel_target

KERNEL_TEST_FILES = ["test_kernels_attention.py", "test_kernels_elementwise.py"]


@pytest.mark.skipif(kernel_target() is not None, reason="this process runs the kernel tests directly")
@pytest.mark.timeout(300)
def test_kernels_pass_under_the_triton_interpreter():
    tests_dir = Path(__file__).parent
    test_files = [str(tests_dir / name) for name in KERNEL_TEST_FILES]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test_files],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=tests_dir.parent,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]
