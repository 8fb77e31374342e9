"""Every command answers `--help`, and each lists under its group with a one-sentence summary
(Typer shows a docstring's first paragraph there: a paragraph that wraps mid-sentence reads
as broken lines)."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.testing import CliRunner

from vlmbatch.cli.commands import app


def _commands(group: typer.Typer, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    found = [((*path, command.name or command.callback.__name__.replace("_", "-")), command.callback)
             for command in group.registered_commands]  # fmt: skip
    for sub in group.registered_groups:
        found += _commands(sub.typer_instance, (*path, sub.name))
    return found


COMMANDS = _commands(app)


def test_every_group_is_walked() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"submit", "worker", "serve", "results", "make-tiny-model", "bench engine", "bench moe"} <= names


@pytest.mark.parametrize("path,callback", COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_command_help_has_a_one_line_summary(path: tuple[str, ...], callback) -> None:
    summary = (inspect.getdoc(callback) or "").split("\n\n")[0]
    assert summary and "\n" not in summary, f"{' '.join(path)}: first paragraph {summary!r}"
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and "--help" in result.output
