"""Storage at scale: trace keys in their own table; on PostgreSQL traces, trace tags and replay
results range-partitioned by week of their trace's created_at.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-22

Why. A million traces a night is about 8 GB of token arrays a night; retention must drop whole
partitions (DETACH + DROP), not delete rows. PostgreSQL requires every unique key of a
partitioned table to contain the partition key, so the keys that make ingest idempotent
(one content per project, one external_id per project, one public id) move to `trace_keys`, a
small table that is not partitioned; ingest inserts the key first and the trace only if its key
went in. Tags and results carry their trace's created_at (`trace_created_at`), are partitioned
on it and reference the trace by (id, created_at), so a week's traces, tags and results are
dropped together and nothing ever points at a dropped trace.

Both databases: `trace_keys` (backfilled), `trace_created_at` on `trace_tags` and
`replay_results` (backfilled), the composite foreign keys, the result key with
`trace_created_at`, an index on (project_id, external_id). SQLite has no partitions and keeps the
unique keys on `traces`; it gets the unique index on traces(id, created_at) that a composite
foreign key needs there. PostgreSQL: each of the three tables is rebuilt as a partitioned table
(a default partition, so an insert never fails, and one partition per week holding data, plus
the current week and four ahead), its rows copied over, its sequence kept.

Static: no imports from the package. Weeks start on Monday 00:00 UTC; a partition of table T
for the week starting D is `T_pYYYYMMDD`, the default one `T_default` (as in
replay_audit/db/partition.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
WEEKS_AHEAD = 4

#: table -> (partition key, primary key columns when partitioned, its id sequence or None)
_PARTITIONED = {
    "traces": ("created_at", "id, created_at", "traces_id_seq"),
    "trace_tags": ("trace_created_at", "trace_id, trace_created_at, tag", None),
    "replay_results": ("trace_created_at", "id, trace_created_at", "replay_results_id_seq"),
}
#: The primary keys before this revision.
_PLAIN_PK = {"traces": "id", "trace_tags": "trace_id, tag", "replay_results": "id"}
#: Indexes that are the same on both shapes (name, table, columns).
_INDEXES = (
    ("ix_traces_config_id", "traces", "config_id"),
    ("ix_traces_project_id_created_at", "traces", "project_id, created_at"),
    ("ix_traces_project_id_model_name", "traces", "project_id, model_name"),
    ("ix_traces_project_id_public_id", "traces", "project_id, public_id"),
    ("ix_traces_project_id_weights_sha256", "traces", "project_id, weights_sha256"),
    ("ix_trace_tags_tag_trace_id", "trace_tags", "tag, trace_id"),
    ("ix_replay_results_category", "replay_results", "category"),
    ("ix_replay_results_run_id", "replay_results", "run_id"),
    ("ix_replay_results_trace_id", "replay_results", "trace_id"),
)
#: Foreign keys from these tables to tables that are not rebuilt.
_OUTER_FKS = (
    (
        "traces",
        "fk_traces_config_id_numerical_configs",
        "FOREIGN KEY (config_id) REFERENCES numerical_configs (id)",
    ),
    (
        "traces",
        "fk_traces_project_id_projects",
        "FOREIGN KEY (project_id) REFERENCES projects (id) ON DELETE CASCADE",
    ),
    (
        "replay_results",
        "fk_replay_results_run_id_replay_runs",
        "FOREIGN KEY (run_id) REFERENCES replay_runs (id) ON DELETE CASCADE",
    ),
)
_RESULT_KEY_OLD = "uq_replay_results_run_id_trace_id_comparison"
_RESULT_KEY_NEW = "uq_replay_results_run_id_trace_id_trace_created_at_comparison"


def _is_sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    op.create_table(
        "trace_keys",
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("content_sha256", sa.String(length=64), nullable=False),
        sa.Column("external_id", sa.String(length=200), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_trace_keys_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("public_id", name=op.f("pk_trace_keys")),
        sa.UniqueConstraint(
            "project_id", "content_sha256", name=op.f("uq_trace_keys_project_id_content_sha256")
        ),
        sa.UniqueConstraint(
            "project_id", "external_id", name=op.f("uq_trace_keys_project_id_external_id")
        ),
    )
    op.create_index(op.f("ix_trace_keys_created_at"), "trace_keys", ["created_at"])
    op.execute(
        "INSERT INTO trace_keys (public_id, project_id, content_sha256, external_id, created_at)"
        " SELECT public_id, project_id, content_sha256, external_id, created_at FROM traces"
    )
    for table in ("trace_tags", "replay_results"):
        op.add_column(table, sa.Column("trace_created_at", TIMESTAMP, nullable=True))
        op.execute(
            f"UPDATE {table} SET trace_created_at ="
            f" (SELECT created_at FROM traces WHERE traces.id = {table}.trace_id)"
        )
    if _is_sqlite():
        _sqlite_upgrade()
    else:
        _postgresql_upgrade()


def _sqlite_upgrade() -> None:
    op.create_index(
        op.f("ix_traces_project_id_external_id"), "traces", ["project_id", "external_id"]
    )
    # A composite foreign key's target must carry a unique index on exactly its columns.
    op.create_index(op.f("ix_traces_id_created_at"), "traces", ["id", "created_at"], unique=True)
    # Batch mode rebuilds these two tables; nothing references them, so dropping the old copy
    # cascades nowhere.
    with op.batch_alter_table("trace_tags") as batch:
        batch.alter_column("trace_created_at", existing_type=TIMESTAMP, nullable=False)
        batch.drop_constraint("fk_trace_tags_trace_id_traces", type_="foreignkey")
        batch.create_foreign_key(
            "fk_trace_tags_trace_id_traces",
            "traces",
            ["trace_id", "trace_created_at"],
            ["id", "created_at"],
            ondelete="CASCADE",
            onupdate="CASCADE",
        )
    with op.batch_alter_table("replay_results") as batch:
        batch.alter_column("trace_created_at", existing_type=TIMESTAMP, nullable=False)
        batch.drop_constraint(_RESULT_KEY_OLD, type_="unique")
        batch.create_unique_constraint(
            _RESULT_KEY_NEW, ["run_id", "trace_id", "trace_created_at", "comparison"]
        )
        batch.drop_constraint("fk_replay_results_trace_id_traces", type_="foreignkey")
        batch.create_foreign_key(
            "fk_replay_results_trace_id_traces",
            "traces",
            ["trace_id", "trace_created_at"],
            ["id", "created_at"],
            ondelete="CASCADE",
            onupdate="CASCADE",
        )


def _weeks_to_create() -> list[datetime]:
    """Monday 00:00 UTC of every week holding a trace, the current week and WEEKS_AHEAD more."""
    rows = op.get_bind().execute(
        sa.text("SELECT DISTINCT date_trunc('week', created_at AT TIME ZONE 'UTC') FROM traces")
    )
    weeks = {row[0].replace(tzinfo=UTC) for row in rows}
    now = datetime.now(UTC)
    this_week = (now - timedelta(days=now.weekday())).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    weeks.update(this_week + timedelta(weeks=i) for i in range(WEEKS_AHEAD + 1))
    return sorted(weeks)


def _execute(*statements: str) -> None:
    for statement in statements:
        op.execute(statement)


def _drop_trace_fks() -> None:
    _execute(
        "ALTER TABLE trace_tags DROP CONSTRAINT fk_trace_tags_trace_id_traces",
        "ALTER TABLE replay_results DROP CONSTRAINT fk_replay_results_trace_id_traces",
    )


def _rebuild(table: str, *, partitioned: bool, weeks: Sequence[datetime] = ()) -> None:
    """Replace `table` by a copy of itself, partitioned (with the weeks' partitions and a
    default one) or not, rows and sequence kept; constraints and indexes are added after."""
    key, _, sequence = _PARTITIONED[table]
    old = f"{table}_rebuilt"
    _execute(f"ALTER TABLE {table} RENAME TO {old}")
    if sequence:
        _execute(f"ALTER SEQUENCE {sequence} OWNED BY NONE")
    how = f" PARTITION BY RANGE ({key})" if partitioned else ""
    _execute(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS INCLUDING CONSTRAINTS){how}")
    if partitioned:
        _execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
        for week in weeks:
            end = week + timedelta(weeks=1)
            _execute(
                f"CREATE TABLE {table}_p{week:%Y%m%d} PARTITION OF {table}"
                f" FOR VALUES FROM ('{week.isoformat()}') TO ('{end.isoformat()}')"
            )
    _execute(f"INSERT INTO {table} SELECT * FROM {old}", f"DROP TABLE {old} CASCADE")
    if sequence:
        _execute(f"ALTER SEQUENCE {sequence} OWNED BY {table}.id")


def _add_keys_and_indexes(*, partitioned: bool) -> None:
    for table, (_, partitioned_pk, _) in _PARTITIONED.items():
        pk = partitioned_pk if partitioned else _PLAIN_PK[table]
        _execute(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({pk})")
    for table, name, definition in _OUTER_FKS:
        _execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")
    indexes = list(_INDEXES)
    if partitioned:
        indexes.append(("ix_traces_project_id_external_id", "traces", "project_id, external_id"))
    for name, table, columns in indexes:
        _execute(f"CREATE INDEX {name} ON {table} ({columns})")


def _postgresql_upgrade() -> None:
    for table in ("trace_tags", "replay_results"):
        op.alter_column(table, "trace_created_at", existing_type=TIMESTAMP, nullable=False)
    weeks = _weeks_to_create()
    _drop_trace_fks()
    for table in ("replay_results", "trace_tags", "traces"):
        _rebuild(table, partitioned=True, weeks=weeks)
    _add_keys_and_indexes(partitioned=True)
    _execute(
        f"ALTER TABLE replay_results ADD CONSTRAINT {_RESULT_KEY_NEW}"
        " UNIQUE (run_id, trace_id, trace_created_at, comparison)",
        *(
            f"ALTER TABLE {table} ADD CONSTRAINT fk_{table}_trace_id_traces FOREIGN KEY"
            " (trace_id, trace_created_at) REFERENCES traces (id, created_at)"
            " ON DELETE CASCADE ON UPDATE CASCADE"
            for table in ("trace_tags", "replay_results")
        ),
    )


def downgrade() -> None:
    if _is_sqlite():
        with op.batch_alter_table("replay_results") as batch:
            batch.drop_constraint("fk_replay_results_trace_id_traces", type_="foreignkey")
            batch.create_foreign_key(
                "fk_replay_results_trace_id_traces",
                "traces",
                ["trace_id"],
                ["id"],
                ondelete="CASCADE",
            )
            batch.drop_constraint(_RESULT_KEY_NEW, type_="unique")
            batch.create_unique_constraint(_RESULT_KEY_OLD, ["run_id", "trace_id", "comparison"])
            batch.drop_column("trace_created_at")
        with op.batch_alter_table("trace_tags") as batch:
            batch.drop_constraint("fk_trace_tags_trace_id_traces", type_="foreignkey")
            batch.create_foreign_key(
                "fk_trace_tags_trace_id_traces", "traces", ["trace_id"], ["id"], ondelete="CASCADE"
            )
            batch.drop_column("trace_created_at")
        op.drop_index(op.f("ix_traces_id_created_at"), table_name="traces")
        op.drop_index(op.f("ix_traces_project_id_external_id"), table_name="traces")
    else:
        _drop_trace_fks()
        for table in ("replay_results", "trace_tags", "traces"):
            _rebuild(table, partitioned=False)
        _add_keys_and_indexes(partitioned=False)
        _execute(
            "ALTER TABLE traces ADD CONSTRAINT uq_traces_project_id_content_sha256"
            " UNIQUE (project_id, content_sha256)",
            "ALTER TABLE traces ADD CONSTRAINT uq_traces_project_id_external_id"
            " UNIQUE (project_id, external_id)",
            "ALTER TABLE traces ADD CONSTRAINT uq_traces_public_id UNIQUE (public_id)",
            f"ALTER TABLE replay_results ADD CONSTRAINT {_RESULT_KEY_OLD}"
            " UNIQUE (run_id, trace_id, comparison)",
            *(
                f"ALTER TABLE {table} ADD CONSTRAINT fk_{table}_trace_id_traces FOREIGN KEY"
                " (trace_id) REFERENCES traces (id) ON DELETE CASCADE"
                for table in ("trace_tags", "replay_results")
            ),
        )
        for table in ("trace_tags", "replay_results"):
            op.drop_column(table, "trace_created_at")
    op.drop_index(op.f("ix_trace_keys_created_at"), table_name="trace_keys")
    op.drop_table("trace_keys")
