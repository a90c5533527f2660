"""`replay-audit traces export`: stored traces as a JSONL file in the shape `POST /v1/traces`,
`import` and `replay` take (an operator's tool: it reads the database directly)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.root import CommandGroup, app
from replay_audit.config import get_settings
from replay_audit.words import counted

traces_app = CommandGroup(help="Stored traces: export.", no_args_is_help=True)
app.add_typer(traces_app, name="traces")

_FILTER_HELP = (
    'A replay request\'s filter as JSON, e.g. \'{"model_name": "m", "dtype": "bf16"}\' '
    "(its traces are greedy: it selects what a replay would)."
)


@traces_app.command("export")
def export(
    project: Annotated[str, typer.Option(help="The project whose traces are exported.")],
    out: Annotated[Path, typer.Option(help="Write the traces here (JSONL).")],
    tag: Annotated[
        list[str] | None, typer.Option(help="Only traces carrying this tag (repeatable).")
    ] = None,
    id: Annotated[
        list[str] | None, typer.Option("--id", help="Only this trace (tr_...; repeatable).")
    ] = None,
    filter: Annotated[str | None, typer.Option("--filter", help=_FILTER_HELP)] = None,
    greedy: Annotated[
        bool, typer.Option(help="Only greedy traces (the ones `replay` takes).")
    ] = False,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many traces.")] = None,
) -> None:
    """Write stored traces, oldest first, one JSON line each as POST /v1/traces takes it: the
    file replays with `replay-audit replay` and posts with `import`'s shape."""
    import dataclasses

    from pydantic import ValidationError

    from replay_audit.auth.repository import get_project
    from replay_audit.cli.database import ready_database
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays.schemas import TraceFilter
    from replay_audit.traces.service import export_traces

    try:
        chosen = TraceFilter.model_validate_json(filter or "{}")
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"--filter: {'.'.join(map(str, err['loc'])) or 'JSON'}: {err['msg']}")
    selection = chosen.to_selection()  # greedy only, as a replay's filter
    tags = (*selection.tags, *(tag or []))
    selection = dataclasses.replace(
        selection, tags=tags, greedy=True if greedy or filter is not None else None
    )
    settings = get_settings()
    ready_database(settings)
    written = 0
    with session_scope(settings.database_url) as s:
        p = get_project(s, project)
        if p is None:
            fail(f"no project {project!r}")
        try:
            sink = out.open("w", encoding="utf-8")
        except OSError as e:
            fail(f"cannot write {out}: {e.strerror}")
        with sink:
            for trace in export_traces(s, p.id, selection, id or [], limit=limit):
                sink.write(trace.posted_json() + "\n")
                written += 1
    typer.echo(f"wrote {counted(written, 'trace')} of project {project} to {out}")
