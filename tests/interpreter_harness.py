"""The kernel test files run under the Triton interpreter in subprocesses of their own.

Whether a kernel is interpreted is fixed when `@triton.jit` runs, at import; in a full
`pytest tests/` run another module may import the kernels first, so the kernel tests get
a fresh interpreter of their own with TRITON_INTERPRET=1. Each run is one single-threaded
process of one to two minutes: `interpreted_kernel_runs` (conftest) starts the selected
ones when the session starts, so they overlap the rest of the suite on the second core,
and the tests in test_kernels_interpreter.py wait for their results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TESTS_DIR = Path(__file__).parent
# test name in test_kernels_interpreter.py -> the kernel test files it runs
RUNS = {
    "test_kernels_pass_under_the_triton_interpreter": ["test_kernels_attention.py", "test_kernels_elementwise.py"],
    # These also hold bf16 GPU cases and sm_90 compile checks, which skip under the interpreter.
    "test_fp8_and_moe_kernels_pass_under_the_triton_interpreter_skipping_only_gpu_cases": ["test_kernels_fp8.py", "test_kernels_moe.py"],
}
TIMEOUT_S = 600


@dataclass
class InterpretedRun:
    """One running `pytest` of kernel test files under the interpreter; output goes to a file
    (a pipe nobody reads until the test would fill and stall it)."""

    process: subprocess.Popen
    output: tempfile.TemporaryFile

    @classmethod
    def start(cls, names: list[str]) -> InterpretedRun:
        output = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *(str(TESTS_DIR / n) for n in names)],
            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=TESTS_DIR.parent, stdout=output, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        return cls(process, output)

    def result(self) -> tuple[int, str]:
        """(exit code, output) once the run ends."""
        returncode = self.process.wait(timeout=TIMEOUT_S)
        self.output.seek(0)
        return returncode, self.output.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()
