"""The vLLM peer's child process harness (`bench.peers.vllm.run_child`) on the CPU.

vLLM's engine puts the root cause of a failed start in its engine-core process's output,
not in the exception the child sees. A stand-in `vllm` package on the child's path (only
the two names the child imports; it fails the way vLLM's engine start fails) checks that
the harness keeps that output in the run's error, where the bench prints it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from vlmbatch.bench.peers.vllm import run_child

FAILING_VLLM = textwrap.dedent(
    """
    import sys
    __version__ = "0-stand-in"

    class SamplingParams:
        pass

    class LLM:
        def __init__(self, **kwargs):
            print("(EngineCore pid=1) ValueError: the root cause of the failed start", file=sys.stderr, flush=True)
            raise RuntimeError("Engine core initialization failed. See root cause above.")
    """
)


def test_a_failed_vllm_start_reports_the_child_output_with_its_root_cause(tmp_path: Path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAILING_VLLM)
    spec = {"model": "unused", "load_format": "dummy", "max_model_len": 64, "gpu_memory_utilization": 0.5}
    result = run_child(spec, 120, tmp_path, dict(os.environ), [str(site)])
    assert result["runs"] == []
    assert "Engine core initialization failed" in result["error"]
    assert "ValueError: the root cause of the failed start" in result["error"]
    assert (tmp_path / "vllm-child.log").exists()
