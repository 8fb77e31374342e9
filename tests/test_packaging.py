"""pyproject's explicit package list against the source tree: a package left off it is
missing from a regular (non-editable) install, where every test here would still pass."""

from __future__ import annotations

import tomllib
from pathlib import Path

from package_source import modules

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_every_package_of_the_tree_is_in_pyprojects_list():
    listed = set(tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - packages == set(), "these listed packages have no __init__.py"
