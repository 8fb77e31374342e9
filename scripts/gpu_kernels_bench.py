#!/usr/bin/env python
"""Check and time the Triton kernels on a GPU in one command (no install needed).

    python scripts/gpu_kernels_bench.py [--no-config-sweep] [--tests]

Prints the tables of `vlmbatch bench kernels` and writes kernels_bench.json into $OUT
when it is set; exits 1 when a kernel disagrees with its reference. `--tests` first runs
tests/test_kernels_*.py on the GPU (needs pytest there). Runs from a bare
checkout: `kernels/` installs as `vlmbatch.kernels` only through `pip install -e .`, so
this script maps it there itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_kernels_package() -> None:
    """Make `vlmbatch.kernels` importable from the checkout, as the editable install does."""
    sys.path.insert(0, str(REPO))
    try:
        import vlmbatch.kernels  # noqa: F401
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "vlmbatch.kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["vlmbatch.kernels"] = module
        spec.loader.exec_module(module)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-config-sweep", action="store_true", help="skip the launch-config sweeps (faster)")
    parser.add_argument("--tests", action="store_true", help="run the kernel tests on the GPU first")
    parser.add_argument("--sections", default="prefill,decode,linear", help="comma-separated: prefill, decode, linear")
    args = parser.parse_args()
    import_kernels_package()
    if args.tests:
        import pytest  # in this process, so the tests see the package mapped above

        tests = sorted(str(path) for path in (REPO / "tests").glob("test_kernels_*.py"))
        if pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(REPO), *tests]) != 0:
            return 1
    from vlmbatch.kernels.bench import run_kernel_bench

    out = os.environ.get("OUT")
    report = run_kernel_bench(Path(out) / "kernels_bench.json" if out else None, sweep_configs=not args.no_config_sweep,
                              sections=tuple(args.sections.split(",")))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
