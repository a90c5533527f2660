"""Service commands: `serve`, `db upgrade`, `keys create`. (`worker` and friends live in
`cli/worker.py`.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from replay_audit.cli.root import CommandGroup, app
from replay_audit.config import get_settings
from replay_audit.words import counted

if TYPE_CHECKING:
    from replay_audit.config import Settings

db_app = CommandGroup(help="Database migrations.", no_args_is_help=True)
keys_app = CommandGroup(help="API keys.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")


def _banner_for_key(key: str, project: str) -> str:
    line = "=" * 72
    return (
        f"{line}\nFirst start: created an admin API key for project {project!r}.\n"
        f"It is shown this once; only its hash is stored.\n\n    {key}\n\n"
        f'Send it in the X-API-Key header (curl -H "X-API-Key: <key>" ...).\n{line}'
    )


def _database_line(settings: Settings) -> str:
    """Which database `serve` uses, and where that choice came from: a SQLite file is shown as
    its absolute path, since the default one is relative to the current directory."""
    from pathlib import Path

    from sqlalchemy.engine import make_url

    from replay_audit.cli.database import shown_url

    url = make_url(settings.database_url)
    shown = shown_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        shown += f" (file {Path(str(url.database)).resolve()})"
    source = (
        "REPLAY_AUDIT_DATABASE_URL"
        if "database_url" in settings.model_fields_set
        else "the default; set REPLAY_AUDIT_DATABASE_URL to choose another"
    )
    return f"database: {shown}, from {source}"


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    migrate: Annotated[
        bool, typer.Option("--migrate/--no-migrate", help="Apply the migrations before serving.")
    ] = True,
    workers: Annotated[
        int, typer.Option(min=1, help="API processes (each single-threaded Python).")
    ] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the HTTP API.

    With no configuration it uses a SQLite file under ./var/, applies the migrations, and on a
    database without any API key creates an admin key for the `default` project and prints it
    once. Set REPLAY_AUDIT_DATABASE_URL=postgresql+psycopg://... to use PostgreSQL.
    """
    import uvicorn

    settings = get_settings()
    _prepare_metrics(settings, workers)  # before anything imports prometheus-client
    from replay_audit.api.app import create_app
    from replay_audit.auth.service import DEFAULT_PROJECT, bootstrap_admin_key
    from replay_audit.cli.database import ready_database
    from replay_audit.cli.demo import DEMO_PROJECT
    from replay_audit.cli.demo import KEY_FILE as DEMO_KEY_FILE
    from replay_audit.db.unit_of_work import session_scope

    ready_database(settings, migrate=migrate)
    with session_scope(settings.database_url) as session:
        key = bootstrap_admin_key(session)
        _store_missing_statistics(session)
    typer.echo(_database_line(settings))
    if key is not None:
        typer.echo(_banner_for_key(key, DEFAULT_PROJECT))
    elif DEMO_KEY_FILE.is_file():  # `demo` made the keys here and printed its own
        typer.echo(
            f"API keys: this database already has some; `replay-audit demo`'s admin key (project"
            f" {DEMO_PROJECT}) is kept in {DEMO_KEY_FILE}, or create one with"
            " `replay-audit keys create`"
        )
    else:
        typer.echo(
            "API keys: this database already has some; use the admin key printed when it was "
            "first served, or create one with `replay-audit keys create`"
        )
    from replay_audit.audits.scheduler import start_inprocess_scheduler
    from replay_audit.cli.shutdown import own
    from replay_audit.queue import build_runner, stop_runner

    # One runner for the app and the scheduler (one replay thread, one set of loaded engines),
    # owned by this command: stopped when it ends, after the scheduler that feeds it.
    runner = build_runner(settings) if workers == 1 else None
    if runner is not None:
        own(lambda timeout_s: stop_runner(runner, timeout_s))
    # The embedded audit scheduler: a daemon thread, none when `rq cron` does the job.
    scheduler = start_inprocess_scheduler(settings, runner=runner)
    if scheduler is not None:
        own(scheduler.stop)
    from replay_audit.api.metrics import serve_metrics
    from replay_audit.api.server import freeze_startup_objects, run_processes, uvicorn_logging
    from replay_audit.telemetry.log import configure_logging

    if settings.log_format == "json":
        configure_logging("json")
    stop_metrics = serve_metrics(settings)  # REPLAY_AUDIT_API_METRICS_PORT: its own listener
    if stop_metrics is not None:
        own(lambda timeout_s: stop_metrics() or True)
    if runner is not None:
        served = create_app(settings, runner=runner)
        freeze_startup_objects()
        uvicorn.run(
            served,
            host=host,
            port=port,
            log_level=log_level,
            **uvicorn_logging(settings.log_format),
        )
    else:
        # Separate processes build their own app from the same environment, on a listening
        # socket bound as TCP so their connections get TCP_NODELAY (api/server.py says why).
        run_processes(
            "replay_audit.api.server:served_app",
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
            log_format=settings.log_format,
        )


def _prepare_metrics(settings: Settings, workers: int) -> None:
    """Several API processes count into files of one directory (prometheus-client's
    multiprocess mode), which a scrape of any of them adds up: PROMETHEUS_MULTIPROC_DIR, or a
    new temporary one. Emptied first: an earlier run's files would add to this one's."""
    import os
    import tempfile
    from pathlib import Path

    from replay_audit.telemetry.multiprocess import (
        MULTIPROC_ENV,
        clear_multiprocess_dir,
        multiprocess_dir,
    )

    path = multiprocess_dir()
    if path is None and workers > 1 and settings.metrics_enabled:
        # Set before the processes start: each reads it when it imports prometheus-client.
        path = Path(tempfile.mkdtemp(prefix="replay-audit-metrics-"))
        os.environ[MULTIPROC_ENV] = str(path)
    if path is not None:
        clear_multiprocess_dir(path)


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Apply the Alembic migrations to REPLAY_AUDIT_DATABASE_URL (default: up to the newest)."""
    from replay_audit.cli.database import database_errors
    from replay_audit.db import migration
    from replay_audit.db.unit_of_work import session_scope

    url = get_settings().database_url
    with database_errors(url):
        migration.upgrade(url, revision)
        typer.echo(f"database at revision {migration.current_revision(url)}")
        if revision == "head":
            with session_scope(url) as session:
                _store_missing_statistics(session)


def _store_missing_statistics(session: Any) -> None:
    """Finished runs whose statistics an upgrade cleared get them stored again (once)."""
    from replay_audit.replays.statistics import store_missing

    n = store_missing(session)
    if n:
        typer.echo(f"stored the statistics of {counted(n, 'finished replay run')}")


@db_app.command("current")
def db_current() -> None:
    """Print the revision the database is at (and the newest one available)."""
    from replay_audit.cli.database import database_errors
    from replay_audit.db import migration

    url = get_settings().database_url
    with database_errors(url):
        current = migration.current_revision(url)
    typer.echo(f"current: {current or '(none)'}  head: {migration.head_revision()}")


@db_app.command("partitions")
def db_partitions(
    weeks_ahead: Annotated[
        int, typer.Option(min=0, help="Weeks to create after the current one.")
    ] = 4,
) -> None:
    """Create the weekly partitions of the trace tables up to WEEKS_AHEAD weeks from now and
    list them (PostgreSQL; the scheduler does the same every tick). SQLite has none."""
    from replay_audit.cli.database import ready_database
    from replay_audit.db import partition
    from replay_audit.db.base import utcnow
    from replay_audit.db.unit_of_work import session_scope

    settings = get_settings()
    ready_database(settings)
    with session_scope(settings.database_url) as session:
        if not partition.is_partitioned(session):
            typer.echo("this database has no partitions (SQLite): nothing to do")
            return
        created = partition.ensure_partitions(session, utcnow(), weeks_ahead)
        weeks = partition.weeks(session)
    for name in created:
        typer.echo(f"created {name}")
    typer.echo(f"{counted(len(weeks), 'week')}: " + ", ".join(f"{w:%Y-%m-%d}" for w in weeks))


@app.command()
def prune(
    older_than: Annotated[
        int,
        typer.Option(
            "--older-than", min=1, help="Delete traces and screenings older than DAYS days."
        ),
    ],
    dry_run: Annotated[bool, typer.Option(help="Report what would go; change nothing.")] = False,
) -> None:
    """Delete the traces older than DAYS days with their tags and results (whole weekly
    partitions on PostgreSQL, DETACH + DROP; batched deletes on SQLite), and the screenings
    older than DAYS days with their stored outputs. Prints what it removed.
    (`REPLAY_AUDIT_RETENTION_DAYS` makes the scheduler do this every tick.)"""
    from datetime import timedelta

    from replay_audit.cli.database import ready_database
    from replay_audit.db.retention import prune as prune_older

    settings = get_settings()
    ready_database(settings)
    report = prune_older(settings.database_url, timedelta(days=older_than), dry_run=dry_run)
    for line in report.lines():
        typer.echo(line)


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name (created if new).")],
    role: Annotated[str, typer.Option(help="submitter | auditor | admin")],
    name: Annotated[str | None, typer.Option(help="A label to recognise the key by.")] = None,
) -> None:
    """Create an API key and print it (once: only its hash is stored). On the embedded default
    the database is created and migrated first."""
    from replay_audit.auth.service import create_api_key
    from replay_audit.cli.database import ready_database
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.exceptions import ReplayAuditError

    settings = get_settings()
    ready_database(settings)
    try:
        with session_scope(settings.database_url) as session:
            key = create_api_key(session, project, role, name=name).key
    except ReplayAuditError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key)
