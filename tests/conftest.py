"""Shared fixtures: tiny random-weight checkpoints, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from vlmbatch.testing.tiny import ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_dir(arch)` -> path of a tiny checkpoint of that family (seed 0), built on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in ARCHS:
            raise ValueError(f"unknown arch {arch!r}")
        if arch not in built:
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_qwen(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="session")
def tiny_llava(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llava")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where there is no CUDA device (the CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
