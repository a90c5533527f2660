"""`replay-audit audit ...`: scheduled re-audits from the command line (an operator's tool: it
talks to the database directly and sees every project).

With the embedded in-process runner the replay jobs run in this process and the command waits
for them; with RQ they go to the workers and `--wait` follows the run until the scheduler has
evaluated it. Drift alerts are always delivered by the scheduler.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from replay_audit.cli.database import fail
from replay_audit.cli.root import CommandGroup, app
from replay_audit.config import get_settings
from replay_audit.words import counted

if TYPE_CHECKING:
    from replay_audit.audits.metrics import CLift
    from replay_audit.audits.models import AuditRun
    from replay_audit.queue import Runner

audit_app = CommandGroup(help="Scheduled re-audits: schedules, runs, trends.", no_args_is_help=True)
app.add_typer(audit_app, name="audit")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _lift(c_lift: CLift | None) -> str:
    """A trend point's C lift, in percentage points."""
    lift = None if c_lift is None else c_lift.lift
    return "-" if lift is None else f"{100 * lift:+.1f} pp"


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _console() -> Any:
    """Rich's console; piped into a file or another program, wide enough not to wrap rows,
    unless COLUMNS says how wide (rich reads it)."""
    from rich.console import Console

    console = Console()
    wide = console.is_terminal or os.environ.get("COLUMNS", "").isdigit()
    return console if wide else Console(width=200)


def _ready() -> None:
    """Each command's first step: the database answers and has the schema (cli/database.py)."""
    from replay_audit.cli.database import ready_database

    ready_database(get_settings())


def _runner() -> Runner:
    """The command's runner, stopped when the command ends, once the database is ready."""
    from replay_audit.cli.shutdown import own
    from replay_audit.queue import build_runner, stop_runner

    _ready()
    runner = build_runner(get_settings())
    own(lambda timeout_s: stop_runner(runner, timeout_s))
    return runner


def _start(schedule_id: str, action: str, limit: int, runner: Runner) -> tuple[list[int], int]:
    """Start run(s) in one transaction: (audit run ids, missed runs left)."""
    from replay_audit.audits import repository, service
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.exceptions import ReplayAuditError
    from replay_audit.queue import build_job_queue
    from replay_audit.replays.service import RunDefaults

    settings = get_settings()
    queue = build_job_queue(settings, runner)
    defaults = RunDefaults.from_settings(settings)
    try:
        with session_scope(settings.database_url) as s:
            schedule = repository.find_schedule(s, schedule_id)
            if schedule is None:
                fail(f"no audit schedule {schedule_id!r}")
            if action == "run-now":
                run, created = service.run_now(s, schedule, queue=queue, defaults=defaults)
                runs, left = [run], 0
                if not created:
                    typer.echo(f"a run due this second exists: {run.public_id}")
            else:
                runs, left = service.catch_up(
                    s, schedule, limit=limit, queue=queue, defaults=defaults
                )
            ids = [r.id for r in runs]
    except ReplayAuditError as e:
        fail(e.message)
    return ids, left


def _finish(ids: list[int], wait: bool, timeout_s: float, runner: Runner) -> None:
    """Wait for the runs' replays and verifications (in this process with the in-process
    runner), evaluate them and print each trend point."""
    from replay_audit.audits import service
    from replay_audit.audits.models import AuditRun
    from replay_audit.audits.tasks import DeferredRunner
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.queue.runner import InProcessRunner

    settings = get_settings()
    inprocess = isinstance(runner, InProcessRunner)
    if isinstance(runner, InProcessRunner):
        runner.join(timeout_s)
    elif not wait:
        _print_runs(ids)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        for run_id in ids if inprocess else ():
            # Nobody else evaluates for us; alerts stay pending for the scheduler.
            with session_scope(settings.database_url) as s:
                service.evaluate_audit_run(
                    s,
                    run_id,
                    alert_runner=DeferredRunner(),
                    webhook_timeout_s=settings.webhook_timeout_s,
                    webhook_retry_intervals_s=settings.webhook_retry_intervals_s,
                )
        with session_scope(settings.database_url) as s:
            statuses = [r.status for r in (s.get(AuditRun, i) for i in ids) if r is not None]
        if all(st != "running" for st in statuses) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    _print_runs(ids)


def _print_runs(ids: list[int]) -> None:
    from replay_audit.audits.metrics import RunMetrics
    from replay_audit.audits.models import AuditRun
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(get_settings().database_url) as s:
        runs: list[AuditRun] = [r for r in (s.get(AuditRun, i) for i in ids) if r is not None]
        for r in runs:
            m = r.metrics or RunMetrics()
            typer.echo(
                f"{r.public_id}  due {_when(r.due_at)}  {r.trigger}  {r.status}  "
                f"sampled {r.n_sampled}/{r.n_candidates}  EAR {_pct(m.ear)}  "
                f"C lift {_lift(m.c_lift)}  "
                f"self {_pct(m.self_agreement)}" + (f"  error: {r.error}" if r.error else "")
            )
            v = m.verification
            if v is not None and v.status == "done":
                verdicts = ", ".join(f"{g.group}: {g.verdict}" for g in v.groups)
                typer.echo(f"    verification {v.id}: {v.verdict} ({verdicts})")
            for f in r.flags or []:
                typer.secho(f"    FLAG {f.kind}: {f.reason}", fg=typer.colors.YELLOW)


@audit_app.command("list")
def list_schedules(
    project: Annotated[str | None, typer.Option(help="Only this project's schedules.")] = None,
) -> None:
    """Every schedule: cron (UTC), status, next due time, last run, missed runs."""
    _ready()
    from rich.table import Table

    from replay_audit.audits import repository, service
    from replay_audit.auth.repository import get_project
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(get_settings().database_url) as s:
        project_id = None
        if project is not None:
            p = get_project(s, project)
            if p is None:
                fail(f"no project {project!r}")
            project_id = p.id
        reads = service.to_reads(s, repository.list_schedules(s, project_id), reveal_webhook=False)
    table = Table(title="audit schedules (times in UTC)")
    table.add_column("id", no_wrap=True, min_width=29)  # to be copied whole into commands
    for col in ("project", "name", "cron", "status", "next due", "last run", "missed"):
        table.add_column(col, overflow="fold")  # narrow: wrapped, never cut to an ellipsis
    for r in reads:
        last = "-" if r.last_run is None else f"{_when(r.last_run.due_at)} {r.last_run.status}"
        table.add_row(
            r.id, r.project, r.name, r.cron, r.status, _when(r.next_due_at), last, str(r.missed)
        )
    _console().print(table)
    if not reads:
        typer.echo("no schedules (create one with POST /v1/audits/schedules)")


@audit_app.command("run-now")
def run_now(
    schedule: Annotated[str, typer.Option(help="Schedule id (as_...).")],
    wait: Annotated[
        bool, typer.Option(help="With RQ: follow the run until it is evaluated.")
    ] = False,
    timeout_s: Annotated[float, typer.Option(help="Longest wait.")] = 3600.0,
) -> None:
    """Run a schedule now: sample its window ending now and replay the sample."""
    runner = _runner()
    ids, _ = _start(schedule, "run-now", 1, runner)
    _finish(ids, wait, timeout_s, runner)


@audit_app.command("catch-up")
def catch_up(
    schedule: Annotated[str, typer.Option(help="Schedule id (as_...).")],
    limit: Annotated[int, typer.Option(min=1, max=100, help="At most this many runs.")] = 100,
    wait: Annotated[
        bool, typer.Option(help="With RQ: follow the runs until they are evaluated.")
    ] = False,
    timeout_s: Annotated[float, typer.Option(help="Longest wait.")] = 3600.0,
) -> None:
    """Start the runs a stopped scheduler missed (newest first), each over its own window."""
    runner = _runner()
    ids, left = _start(schedule, "catch-up", limit, runner)
    if not ids:
        typer.echo("no missed runs")
        return
    _finish(ids, wait, timeout_s, runner)
    if left:
        typer.echo(f"{counted(left, 'missed run')} left; run catch-up again")


@audit_app.command("trend")
def trend(
    schedule: Annotated[str, typer.Option(help="Schedule id (as_...).")],
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 30,
) -> None:
    """The schedule's trend: one line per run, oldest first."""
    _ready()
    from rich.table import Table

    from replay_audit.audits import repository, service
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(get_settings().database_url) as s:
        sched = repository.find_schedule(s, schedule)
        if sched is None:
            fail(f"no audit schedule {schedule!r}")
        points = service.trend(s, sched, limit=limit).points
    table = Table(title=f"trend of {schedule}")
    for col in ("due (UTC)", "status", "n", "EAR", "C lift", "trigger rate", "self", "flags"):
        table.add_column(col, overflow="fold")
    for p in points:
        table.add_row(
            _when(p.due_at),
            p.status,
            str(p.n_sampled),
            _pct(p.ear),
            _lift(p.c_lift),
            _pct(p.trigger_rate),
            _pct(p.self_agreement),
            ", ".join(f"{f.kind} ({f.label or f.comparison})" for f in p.flags) or "-",
        )
    _console().print(table)


@audit_app.command("tick")
def tick() -> None:
    """One scheduler pass now (what `rq cron` and the embedded scheduler run every minute)."""
    from replay_audit.audits.tasks import build_alert_runner, run_tick
    from replay_audit.cli.shutdown import own
    from replay_audit.queue import stop_runner
    from replay_audit.queue.runner import InProcessRunner

    settings = get_settings()
    runner = _runner()
    alerts = build_alert_runner(settings)
    own(lambda timeout_s: stop_runner(alerts, timeout_s))
    report = run_tick(settings, runner=runner, alert_runner=alerts)
    if isinstance(runner, InProcessRunner):
        runner.join()
    typer.echo(
        f"started {report.started}, evaluated {report.evaluated} (flagged {report.flagged}), "
        f"alerts enqueued {report.alerts_enqueued}, jobs reconciled {report.jobs_reconciled}, "
        f"errors {report.errors}"
    )
