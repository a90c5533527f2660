"""The root of the `replay-audit` command: `app`, the group every command module registers its
commands on, and `CommandGroup`, the Typer group with click's plain help. Kept apart from the
package's `__init__` (which imports every command module) so that importing `app` is no cycle.

`app` is the last line of defence: a database that goes away mid-command, or a setting that
does not parse, is one line on stderr and exit code 2, not a traceback; and it stops the
command's threads on Ctrl-C and SIGTERM too (`cli/shutdown.py`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption
from typer.models import CommandFunctionType

from replay_audit.formats import RunOption


def _reason(error: Any) -> str:
    """A validation error's message without pydantic's "Value error, " before a validator's
    own words."""
    cause = (error.get("ctx") or {}).get("error")
    return str(cause) if error.get("type") == "value_error" and cause is not None else error["msg"]


def _failure(exc: Exception) -> str | None:
    """The one line for an error a user can fix (None: a bug, which keeps its traceback)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.title == "Settings":
        problems = "; ".join(
            f"REPLAY_AUDIT_{'_'.join(map(str, e['loc'])).upper()}: {_reason(e)}"
            for e in exc.errors()
        )
        return f"invalid settings: {problems}"
    from replay_audit.cli.database import describe_database_error
    from replay_audit.config import get_settings

    return describe_database_error(exc, get_settings().database_url)


#: Typer's type labels, in click's words (what `--help` printed before Typer 0.29).
_TYPE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH"}


def _type_name(param: TyperArgument | TyperOption, ctx: Any) -> str:
    label = param.display_type(ctx).strip("<>")
    label = label.removesuffix(" range")  # the range itself is printed beside it
    if label.startswith("list[") and label.endswith("]"):  # a repeatable option or argument
        label = label[5:-1]
    return _TYPE_NAMES.get(label, label if "|" in label else label.upper())  # choices as typed


class _Argument(TyperArgument):
    """`TRACES` in the usage line (`[TRACES]` when optional), its type as a word."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return _type_name(self, ctx)

    def _usage_display_name(self) -> str:
        name = (self.metavar or self.name or "").upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")


class _Option(TyperOption):
    """A flag shows no value (Typer 0.29 prints `<bool>`), an option its metavar or type word."""

    def display_type_rich(self, ctx: Any) -> str | None:
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return None
        return _type_name(self, ctx)


def _plain(params: list[Any]) -> list[Any]:
    # Typer builds its own parameter objects and takes no class for them; these subclasses
    # only change how the help prints them, so the instances are re-classed in place.
    for p in params:
        if type(p) is TyperArgument:
            p.__class__ = _Argument
        elif type(p) is TyperOption:
            p.__class__ = _Option
    return params


def _unwrapped(text: str | None) -> str | None:
    """A docstring's paragraphs as single lines, for the terminal to wrap: Typer keeps the
    source's line breaks after the first paragraph, which at 80 columns makes ragged lines.
    Indented lines (examples) and `\b` blocks keep their breaks."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        p
        if p.startswith("\b") or any(line.startswith(" ") for line in p.splitlines())
        else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
    )


class _HelpTable(Table):
    """Typer's options table with the names never cut ("--control-fracti…" at 80 columns):
    every column but the help text keeps its width, and the help text folds a word longer
    than its column (an environment variable's name) instead of cutting it."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        for cell in renderables[-1:]:  # the help text: Text, or Columns of Text
            for text in getattr(cell, "renderables", [cell]):
                if isinstance(text, Text):
                    text.overflow = "fold"
        super().add_row(*renderables, **kwargs)
        *names, text = self.columns
        for column in names[:-1]:  # the type column may wrap (a long range)
            column.no_wrap = True
        text.overflow = "fold"


@contextmanager
def _whole_names() -> Iterator[None]:
    import typer.rich_utils as rich_utils

    saved = getattr(rich_utils, "Table")  # noqa: B009 (not exported: mypy)
    setattr(rich_utils, "Table", _HelpTable)  # noqa: B010
    try:
        yield
    finally:
        setattr(rich_utils, "Table", saved)  # noqa: B010


class _PlainHelp:
    """Help that reads as click's: `TEXT`, `PATH`, flags bare, `MODEL_DIR`; the docstring in
    paragraphs, option names whole. Mixed into a typer command or group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["help"] = _unwrapped(kwargs.get("help"))
        super().__init__(*args, **kwargs)

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))  # type: ignore[misc]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _whole_names():
            super().format_help(ctx, formatter)  # type: ignore[misc]


class _Command(_PlainHelp, TyperCommand):
    """A command with plain help."""


class _Group(_PlainHelp, TyperGroup):
    """A group of commands with plain help."""


class CommandGroup(typer.Typer):
    """`typer.Typer` whose groups and commands print plain help (see `_Command`). Every
    `replay-audit` command hangs off one of these."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cls", _Group)
        super().__init__(**kwargs)

    def command(
        self, *args: Any, **kwargs: Any
    ) -> Callable[[CommandFunctionType], CommandFunctionType]:
        kwargs.setdefault("cls", _Command)
        return super().command(*args, **kwargs)


def _version(value: bool) -> None:
    if value:
        from replay_audit import __version__

        typer.echo(f"replay-audit {__version__}")
        raise typer.Exit()


class _App(CommandGroup):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from replay_audit.cli.shutdown import stopping_threads_on_exit

        with stopping_threads_on_exit():  # Ctrl-C and SIGTERM: cli/shutdown.py
            try:
                return super().__call__(*args, **kwargs)
            except Exception as exc:
                message = _failure(exc)
                if message is None:
                    raise
                typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
                sys.exit(2)


def option(run_option: RunOption[Any], **kwargs: Any) -> Any:
    """The typer option of a run option: its bounds and help (the same as the API's)."""
    low = run_option.ge if run_option.ge is not None else run_option.gt
    return typer.Option(min=low, max=run_option.le, help=run_option.help, **kwargs)


app = _App(
    name="replay-audit",
    help="Cross-precision replay and audit of LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Cross-precision replay and audit of LLM inference."""
