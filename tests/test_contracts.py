"""docs/contracts.md names every configuration option with its variable, so the documented
contract and the code cannot drift apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmbatch.config import EngineConfig, MediaConfig, QueueConfig, WorkerConfig, describe

CONTRACTS = (Path(__file__).resolve().parent.parent / "docs" / "contracts.md").read_text()


@pytest.mark.parametrize("config", [EngineConfig, MediaConfig, QueueConfig, WorkerConfig])
def test_every_option_is_documented_with_its_variable(config):
    missing = [f"{name} ({env})" for name, env, _, _ in describe(config)
               if f"`{name}`" not in CONTRACTS or (env and f"`{env}`" not in CONTRACTS)]
    assert not missing, f"docs/contracts.md lacks {missing}"
