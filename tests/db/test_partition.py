"""Storage at scale: weekly partitions on PostgreSQL, retention on both databases, and
idempotent ingest across partitions.

Traces are stored at chosen times by fixing the ingest clock (`traces.service.utcnow`). The
PostgreSQL database lives for the test session and keeps the partitions a test made, so every
test uses weeks of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from replay_audit.audits.tasks import TickReport, maintain_storage
from replay_audit.db import partition
from replay_audit.db.retention import prune
from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays import repository as replays_repository
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.results import failed_values
from replay_audit.traces.models import Trace, TraceKey, TraceTag
from tests.cli.conftest import cli_env, run_cli
from tests.conftest import ApiKeyFactory
from tests.factories import make_trace

Ingest = Callable[..., dict[str, Any]]


def _monday(year: int, month: int, day: int) -> datetime:
    week = datetime(year, month, day, tzinfo=UTC)
    assert week.weekday() == 0
    return week


@pytest.fixture
def ingest(client: TestClient, api_key: ApiKeyFactory, monkeypatch: pytest.MonkeyPatch) -> Ingest:
    """ingest(at, trace) -> the POST's JSON and status, stored as if sent at `at`."""
    headers = {"X-API-Key": api_key("submitter")}

    def post(at: datetime, trace: dict[str, Any]) -> dict[str, Any]:
        monkeypatch.setattr("replay_audit.traces.service.utcnow", lambda: at)
        response = client.post("/v1/traces", json=trace, headers=headers)
        return {"status": response.status_code, **response.json()}

    return post


def _trace_row(db_url: str, public_id: str) -> Trace:
    with session_scope(db_url) as s:
        row = s.scalar(select(Trace).where(Trace.public_id == public_id))
        assert row is not None
        return row


def _add_result(db_url: str, public_id: str) -> None:
    """One result of a one-trace run, stored as a replay job stores it."""
    trace = _trace_row(db_url, public_id)
    with session_scope(db_url) as s:
        run = ReplayRun(
            public_id=f"rr_{public_id}",
            project_id=trace.project_id,
            mode="decode",
            compare="logged",
            request={},
            targets=[],
            comparisons=[],
            n_traces=1,
            n_items=1,
        )
        s.add(run)
        s.flush()
        replays_repository.insert_results(s, run.id, trace.id, [failed_values(0, "test")])


def _partition_of(db_url: str, table: str, where: str) -> str:
    with session_scope(db_url) as s:
        return str(s.scalar(text(f"SELECT tableoid::regclass::text FROM {table} WHERE {where}")))


def _counts(db_url: str) -> dict[str, int]:
    with session_scope(db_url) as s:
        return {
            name: int(s.scalar(text(f"SELECT count(*) FROM {name}")) or 0)
            for name in ("traces", "trace_tags", "trace_keys", "replay_results")
        }


@pytest.mark.postgres
def test_the_migration_partitions_the_trace_tables_and_makes_weeks_ahead(
    postgres_database_url: str,
) -> None:
    with session_scope(postgres_database_url) as s:
        assert partition.is_partitioned(s)
        kinds = dict(
            s.execute(
                text(
                    "SELECT relname, relkind::text FROM pg_class WHERE relname IN"
                    " ('traces', 'trace_tags', 'replay_results', 'trace_keys')"
                )
            ).all()
        )
        weeks = partition.weeks(s)
    assert kinds == {"traces": "p", "trace_tags": "p", "replay_results": "p", "trace_keys": "r"}
    this_week = partition.week_start(datetime.now(UTC))
    assert {this_week + i * partition.WEEK for i in range(partition.WEEKS_AHEAD + 1)} <= set(weeks)


@pytest.mark.postgres
def test_ensure_partitions_creates_each_week_once_for_all_three_tables(
    postgres_database_url: str,
) -> None:
    now = datetime(2031, 3, 5, 12, tzinfo=UTC)  # a Wednesday
    with session_scope(postgres_database_url) as s:
        created = partition.ensure_partitions(s, now, weeks_ahead=1)
    assert created == [
        f"{table}_p{day}"
        for day in ("20310303", "20310310")
        for table in ("traces", "trace_tags", "replay_results")
    ]
    with session_scope(postgres_database_url) as s:
        assert partition.ensure_partitions(s, now, weeks_ahead=1) == []
        bounds = s.scalar(
            text(
                "SELECT pg_get_expr(relpartbound, oid) FROM pg_class"
                " WHERE relname = 'replay_results_p20310303'"
            )
        )
    assert "2031-03-03" in str(bounds) and "2031-03-10" in str(bounds)


def test_rows_land_in_their_weeks_partition_and_ingest_stays_idempotent_across_weeks(
    db_url: str, is_postgres: bool, ingest: Ingest
) -> None:
    week_a, week_b = _monday(2030, 1, 7), _monday(2030, 1, 14)
    with session_scope(db_url) as s:
        partition.ensure_partitions(s, week_a, weeks_ahead=1)
    trace = make_trace(external_id="ext-1", tags=["nightly"])
    first = ingest(week_a + timedelta(days=2), trace)
    assert first["status"] == 201 and first["created"] is True
    _add_result(db_url, first["id"])

    # The same content a week later (another partition): the same trace, not a second one.
    again = ingest(week_b + timedelta(days=1), trace)
    assert again["status"] == 200 and again["created"] is False and again["id"] == first["id"]
    # Its external_id with other content a week later: refused, naming the field.
    other = make_trace(external_id="ext-1")
    clash = ingest(week_b + timedelta(days=1), other)
    assert clash["status"] == 409 and clash["field"] == "external_id"
    assert _counts(db_url) == {"traces": 1, "trace_tags": 1, "trace_keys": 1, "replay_results": 1}
    if is_postgres:
        where = f"public_id = '{first['id']}'"
        assert _partition_of(db_url, "traces", where) == "traces_p20300107"
        trace_id = _trace_row(db_url, first["id"]).id
        assert (
            _partition_of(db_url, "trace_tags", f"trace_id = {trace_id}") == "trace_tags_p20300107"
        )
        assert (
            _partition_of(db_url, "replay_results", f"trace_id = {trace_id}")
            == "replay_results_p20300107"
        )


def test_retries_of_one_batch_in_two_weeks_store_each_trace_once(
    db_url: str, client: TestClient, api_key: ApiKeyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers = {"X-API-Key": api_key("submitter")}
    batch = {"traces": [make_trace(), make_trace(), make_trace(external_id="e")]}
    statuses = []
    for at in (_monday(2030, 2, 4), _monday(2030, 2, 11)):
        monkeypatch.setattr("replay_audit.traces.service.utcnow", lambda at=at: at)
        response = client.post("/v1/traces:batch", json=batch, headers=headers)
        statuses.append([item["status"] for item in response.json()["results"]])
    assert statuses == [[201, 201, 201], [200, 200, 200]]
    assert _counts(db_url)["traces"] == 3


def test_a_trace_beyond_the_partitions_goes_to_the_default_and_moves_when_its_week_comes(
    db_url: str, is_postgres: bool, ingest: Ingest
) -> None:
    far = _monday(2032, 6, 7) + timedelta(hours=5)
    stored = ingest(far, make_trace(tags=["later"]))
    assert stored["status"] == 201
    _add_result(db_url, stored["id"])
    trace_id = _trace_row(db_url, stored["id"]).id
    with session_scope(db_url) as s:
        created = partition.ensure_partitions(s, far, weeks_ahead=0)
    expected = {"traces": 1, "trace_tags": 1, "trace_keys": 1, "replay_results": 1}
    assert _counts(db_url) == expected
    if not is_postgres:
        assert created == []  # SQLite: no partitions, nothing to create
        return
    assert created == ["traces_p20320607", "trace_tags_p20320607", "replay_results_p20320607"]
    for table, column in (
        ("traces", "id"),
        ("trace_tags", "trace_id"),
        ("replay_results", "trace_id"),
    ):
        assert _partition_of(db_url, table, f"{column} = {trace_id}") == f"{table}_p20320607"
        with session_scope(db_url) as s:
            assert s.scalar(text(f"SELECT count(*) FROM {table}_default")) == 0


def _store_weeks(
    db_url: str, ingest: Ingest, weeks: list[datetime]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Two traces (Monday 01:00 and Wednesday 02:00), each with a tag and a result, per week."""
    with session_scope(db_url) as s:
        for week in weeks:
            partition.ensure_partitions(s, week, weeks_ahead=0)
    ids, traces = [], []
    for week in weeks:
        for hour in (1, 50):
            trace = make_trace(tags=["t"])
            stored = ingest(week + timedelta(hours=hour), trace)
            assert stored["status"] == 201
            _add_result(db_url, stored["id"])
            ids.append(stored["id"])
            traces.append(trace)
    return ids, traces


def test_prune_removes_exactly_the_old_weeks_and_dry_run_changes_nothing(
    db_url: str, is_postgres: bool, ingest: Ingest
) -> None:
    weeks = [_monday(2024, 1, 1), _monday(2024, 1, 8), _monday(2024, 1, 15)]
    ids, traces = _store_weeks(db_url, ingest, weeks)
    # Cutoff: the third week's Tuesday. Weeks one and two end before it; week three's first
    # trace (Monday 01:00) is older than the cutoff but shares a partition with a newer one.
    now = weeks[2] + timedelta(days=1, hours=30)
    older_than = timedelta(days=1)
    cutoff = now - older_than
    before = _counts(db_url)

    dry = prune(db_url, older_than, now=now, dry_run=True)
    assert _counts(db_url) == before
    assert dry.cutoff == cutoff and dry.dry_run

    report = prune(db_url, older_than, now=now, batch_size=3)
    with session_scope(db_url) as s:
        left = set(s.scalars(select(Trace.public_id)))
        left_keys = set(s.scalars(select(TraceKey.public_id)))
        left_results = s.scalar(text("SELECT count(*) FROM replay_results"))
        left_tags = s.scalar(select(text("count(*)")).select_from(TraceTag))
        dangling = s.scalar(
            select(text("count(*)"))
            .select_from(ReplayResult)
            .where(~select(Trace.id).where(Trace.id == ReplayResult.trace_id).exists())
        )
        remaining_weeks = partition.weeks(s)
    if is_postgres:
        # Whole weeks: the two old weeks' partitions are gone, the third stays whole. (Other
        # tests' old weeks, empty by now, may go too: the database is shared.)
        ours = [w for w in report.weeks if w.week in weeks]
        assert [w.week for w in ours] == weeks[:2]
        assert [(w.rows["traces"], w.rows["replay_results"]) for w in ours] == [(2, 2), (2, 2)]
        assert [w.week for w in dry.weeks if w.week in weeks] == weeks[:2]
        assert report.traces_deleted == 0 and dry.traces_removed == 4
        assert set(weeks[:2]).isdisjoint(remaining_weeks) and weeks[2] in remaining_weeks
        assert left == set(ids[4:])
    else:
        # Row by row: every trace older than the cutoff.
        assert report.weeks == [] and remaining_weeks == [] and report.keys_deleted == 5
        assert left == {ids[5]}
        assert dry.traces_removed == 5 and dry.results_removed == 5
    assert report.traces_removed == len(ids) - len(left)
    assert report.results_removed == len(ids) - len(left)
    assert left_keys == left and left_results == len(left) and left_tags == len(left)
    assert dangling == 0
    assert any("removed" in line for line in report.lines())

    # A pruned trace's content is new again (its key went with it); a kept one's is not.
    assert ingest(now, traces[0])["status"] == 201
    assert ingest(now, traces[5]) | {"status": 200} == ingest(now, traces[5])


def test_scheduler_tick_creates_partitions_and_applies_the_retention_setting(
    db_url: str, is_postgres: bool, ingest: Ingest, make_settings: Callable[..., Any]
) -> None:
    weeks = [_monday(2023, 5, 1), _monday(2023, 5, 8)]
    ids, _ = _store_weeks(db_url, ingest, weeks)
    now = _monday(2023, 5, 29)
    _store_screening(db_url, "sc_may", weeks[0])
    report = TickReport()
    maintain_storage(make_settings(retention_days=14), db_url, now, report)
    with session_scope(db_url) as s:
        left = set(s.scalars(select(Trace.public_id)))
        have = set(partition.weeks(s))
    # Cutoff May 15: both weeks (ending May 8 and May 15) are older, and so is the screening.
    assert left.isdisjoint(ids) and report.traces_pruned == 4
    assert report.screenings_pruned == 1 and _screenings(db_url) == (set(), 0)
    if is_postgres:
        assert report.partitions_created == 3 * (partition.WEEKS_AHEAD + 1)
        assert {now + i * partition.WEEK for i in range(partition.WEEKS_AHEAD + 1)} <= have
    else:
        assert report.partitions_created == 0

    # Without the setting nothing is deleted.
    kept, _ = _store_weeks(db_url, ingest, [_monday(2023, 4, 3)])
    maintain_storage(make_settings(), db_url, now, TickReport())
    with session_scope(db_url) as s:
        assert set(kept) <= set(s.scalars(select(Trace.public_id)))


@pytest.mark.slow
def test_prune_and_partitions_commands(
    db_url: str, is_postgres: bool, ingest: Ingest, tmp_path: Path
) -> None:
    _store_weeks(db_url, ingest, [_monday(2022, 1, 3)])
    _store_screening(db_url, "sc_2022", _monday(2022, 1, 3))
    _store_screening(db_url, "sc_today", datetime.now(UTC))
    env = cli_env(database_url=db_url)
    dry = run_cli(["prune", "--older-than", "30", "--dry-run"], env=env, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "would remove" in dry.stdout and "total: would remove 2 traces, 2 results" in dry.stdout
    assert "would remove 1 screening (3 stored outputs)" in dry.stdout
    assert _counts(db_url)["traces"] == 2
    done = run_cli(["prune", "--older-than", "30"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "total: removed 2 traces, 2 results" in done.stdout
    assert "removed 1 screening (3 stored outputs)" in done.stdout
    assert _counts(db_url)["traces"] == 0
    assert _screenings(db_url) == ({"sc_today"}, 3)
    bad = run_cli(["prune", "--older-than", "0"], env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "older-than" in bad.stderr

    ahead = run_cli(["db", "partitions", "--weeks-ahead", "6"], env=env, cwd=tmp_path)
    assert ahead.returncode == 0, ahead.stderr
    if is_postgres:
        sixth = partition.week_start(datetime.now(UTC)) + 6 * partition.WEEK
        assert f"created traces_p{sixth:%Y%m%d}" in ahead.stdout
        assert f"{sixth:%Y-%m-%d}" in ahead.stdout.splitlines()[-1]
    else:
        assert "no partitions" in ahead.stdout


def _store_screening(
    db_url: str, name: str, at: datetime, *, status: str = "done", heartbeat: datetime | None = None
) -> None:
    """A screening created at `at` with three stored outputs, as its job leaves them."""
    from replay_audit.auth.models import Project
    from replay_audit.screenings.models import Screening, ScreeningOutput

    with session_scope(db_url) as s:
        project = s.scalar(select(Project).where(Project.name == "retention"))
        if project is None:
            project = Project(name="retention")
            s.add(project)
            s.flush()
        row = Screening(
            public_id=name,
            project_id=project.id,
            status=status,
            model_sha256="0" * 64,
            request={},
            created_at=at,
            updated_at=heartbeat or at,
        )
        s.add(row)
        s.flush()
        for key in ("plan", "decode/x/0", "run/x"):
            s.add(ScreeningOutput(screening_id=row.id, key=key, value={"k": key}))


def _screenings(db_url: str) -> tuple[set[str], int]:
    from replay_audit.screenings.models import Screening, ScreeningOutput

    with session_scope(db_url) as s:
        names = set(s.scalars(select(Screening.public_id)))
        outputs = s.scalar(select(text("count(*)")).select_from(ScreeningOutput))
    return names, int(outputs or 0)


def test_prune_deletes_old_screenings_with_their_outputs(db_url: str, is_postgres: bool) -> None:
    now = datetime(2025, 3, 1, tzinfo=UTC)
    _store_screening(db_url, "sc_old_done", now - timedelta(days=40))
    _store_screening(db_url, "sc_old_failed", now - timedelta(days=31), status="failed")
    # Created long ago but a worker wrote to it an hour ago: it is kept.
    _store_screening(
        db_url, "sc_old_running", now - timedelta(days=60), status="running",
        heartbeat=now - timedelta(hours=1),
    )  # fmt: skip
    # Queued long ago and never picked up: it goes.
    _store_screening(db_url, "sc_old_stuck", now - timedelta(days=35), status="queued")
    _store_screening(db_url, "sc_new", now - timedelta(days=29))
    older_than = timedelta(days=30)

    dry = prune(db_url, older_than, now=now, dry_run=True)
    assert (dry.screenings_deleted, dry.screening_outputs_deleted) == (3, 9)
    assert _screenings(db_url) == (
        {"sc_old_done", "sc_old_failed", "sc_old_running", "sc_old_stuck", "sc_new"},
        15,
    )
    assert "would remove 3 screenings (9 stored outputs)" in dry.lines()

    report = prune(db_url, older_than, now=now, batch_size=2)  # two batches
    assert (report.screenings_deleted, report.screening_outputs_deleted) == (3, 9)
    assert _screenings(db_url) == ({"sc_old_running", "sc_new"}, 6)
    assert "removed 3 screenings (9 stored outputs)" in report.lines()
    again = prune(db_url, older_than, now=now)
    assert again.screenings_deleted == 0 and _screenings(db_url)[1] == 6
