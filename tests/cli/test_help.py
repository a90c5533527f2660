"""`replay-audit --version`, and every command's `--help` in plain words: no `<bool>`, `<str>`
or `{model_dir}` placeholders (what Typer 0.29 prints by default)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import metadata

import click
import pytest
import typer
from typer.testing import CliRunner

from replay_audit import __version__
from replay_audit.cli import app

runner = CliRunner()
#: `<bool>`, `<int range>`, `<path>`, `{model_dir}`, `{traces}`: types and names left as code.
PLACEHOLDER = re.compile(r"<[a-z][a-z \[\]|,]*>|\{[a-z_]+\}")


def _commands(group: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


def test_version_is_the_installed_distribution() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"replay-audit {__version__}"
    assert __version__ == metadata.version("replay-audit")


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p in COMMANDS}
    assert {"", "serve", "replay", "hash-model", "worker", "db upgrade", "audit tick"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "replay-audit")
def test_help_has_no_placeholders(path: tuple[str, ...]) -> None:
    r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output and "--help" in r.output
    assert PLACEHOLDER.findall(r.output) == [], r.output


def test_help_names_arguments_and_types_as_words() -> None:
    r = runner.invoke(app, ["hash-model", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"Usage: .*hash-model \[OPTIONS\] MODEL_DIR\s*$", r.output, re.M), r.output
    r = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"})
    assert re.search(r"--model\s+PATH", r.output) and re.search(r"--tau\s+FLOAT", r.output)
    assert re.search(r"--top-k\s+INTEGER \[2<=x<=20\]", r.output), r.output


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "replay-audit")
def test_help_at_80_columns_cuts_no_name(path: tuple[str, ...]) -> None:
    """Issue 20: `--control-fracti…`, `REPLAY_AUDIT_TORC…` at 80 columns."""
    r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "…" not in r.output, r.output
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    for param in command.params:
        if getattr(param, "hidden", False):  # not for users (worker --member, set by its group)
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", r.output), opt


def test_help_docstrings_are_paragraphs_not_source_lines() -> None:
    """A docstring's hard wraps made ragged lines at 80 columns ("... stay in --out, \\n their
    \\n summary ..."): each paragraph is wrapped by the terminal's width."""
    r = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    lines = [line.strip() for line in r.output.splitlines()]
    assert "their" not in lines, r.output
    wide = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert re.search(r"stay in --out, their summary is printed", wide.output), wide.output
