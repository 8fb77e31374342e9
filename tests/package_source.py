"""The modules of the installed package, found from its source files (nothing imported):
what the structure tests (import graph, configuration edges) read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import vlmbatch

# The package itself and the top-level folders pyproject's package-dir maps into it.
ROOTS = ("vlmbatch", "vlmbatch.cli", "vlmbatch.kernels", "vlmbatch.workers")


def package_dirs() -> dict[str, Path]:
    """Where each root package's source lives in this installation."""
    dirs = {"vlmbatch": Path(vlmbatch.__file__).parent}
    for name in ROOTS[1:]:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
        dirs[name] = Path(list(spec.submodule_search_locations)[0])
    return dirs


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is named by its `__init__`)."""
    found: dict[str, Path] = {}
    dirs = package_dirs()
    mapped = {path.resolve() for name, path in dirs.items() if name != "vlmbatch"}
    for root, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if root == "vlmbatch" and any(path.resolve().is_relative_to(m) for m in mapped):
                continue  # reached through its own root
            if any(not (folder / p / "__init__.py").exists() for p in relative.parents if str(p) != "."):
                continue  # not inside a package (a stray script folder)
            parts = [root, *relative.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found
