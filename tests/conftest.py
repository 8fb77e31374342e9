"""Shared fixtures: tiny random-weight checkpoints and a real S3 server, built once per test session."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from interpreter_harness import RUNS, InterpretedRun
from s3_harness import S3Endpoint, SeaweedServer
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


@pytest.fixture(scope="session", autouse=True)
def interpreted_kernel_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, InterpretedRun]]:
    """The selected interpreter runs of test_kernels_interpreter.py, started with the session
    so they overlap the other tests (`interpreter_harness`); killed at its end if unfinished."""
    selected = {item.name for item in request.session.items} & RUNS.keys()
    if selected:  # (only then is triton imported here)
        from vlmbatch.kernels.testing import kernel_target

        selected = selected if kernel_target() is None else set()
    runs = {name: InterpretedRun.start(RUNS[name]) for name in sorted(selected)}
    yield runs
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """SeaweedFS on private ports with one bucket; skipped (with the reason) where `weed` cannot run."""
    folder = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedServer(folder)
    try:
        endpoint = server.start()
    except (FileNotFoundError, OSError) as exc:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no S3 server for the object-storage tests: {exc}")
    try:
        yield endpoint
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where there is no CUDA device (the CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
