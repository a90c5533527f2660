"""SQL for numerical configurations, traces, their tags and their keys.

Inserts are `INSERT ... ON CONFLICT DO NOTHING RETURNING`, one round trip per table and batch:
the unique constraints (on `trace_keys`: `models.TraceKey`) decide what is a duplicate, so
concurrent retries cannot store a trace twice, and nothing is checked-then-inserted.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, NamedTuple, TypeVarTuple

import orjson
from sqlalchemy import JSON, ColumnElement, Select, Table, exists, not_, or_, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import InstrumentedAttribute, Session, contains_eager, defer
from typing_extensions import TypedDict

from replay_audit.db.base import Base
from replay_audit.db.engine import dialect_insert
from replay_audit.json_value import JsonObject
from replay_audit.traces.models import NumericalConfigRow, Trace, TraceKey, TraceTag
from replay_audit.traces.selection import GREEDY, TraceSelection

_Ts = TypeVarTuple("_Ts")

_ARRAY_COLUMNS = (
    Trace.prompt_token_ids,
    Trace.output_token_ids,
    Trace.top_k_ids,
    Trace.top_k_logits,
    Trace.prompt_text,
    Trace.prompt_messages,
    Trace.output_text,
    Trace.output_token_pieces,
    Trace.reference_answer,
)
#: Rows per IN (...) list: well under SQLite's 32,766 bound parameters.
_IN_CHUNK = 5000


# The rows the inserts take, in database form (packed bytes, aware datetimes).


class ConfigValues(TypedDict):
    public_id: str
    content_sha256: str
    config_json: str
    dtype: str
    lm_head_dtype: str
    attn_kernel: str
    device: str
    gpu_name: str | None
    gpu_sm: str | None
    batch_size: int | None
    created_at: datetime


class TraceKeyValues(TypedDict):
    public_id: str
    project_id: int
    content_sha256: str
    external_id: str | None
    created_at: datetime


class TraceContent(TypedDict):
    """A trace's own columns (what its content hash covers, and the counts)."""

    model_name: str
    model_revision: str | None
    weights_sha256: str
    vocab_size: int
    decoding: JsonObject
    prompt_token_ids: bytes
    output_token_ids: bytes
    n_prompt_tokens: int
    n_output_tokens: int
    top_k: int | None
    top_k_ids: bytes | None
    top_k_logits: bytes | None
    prompt_text: str | None
    prompt_messages: list[dict[str, str]] | None
    output_text: str | None
    output_token_pieces: list[str | list[int]] | None
    tags: list[str]
    external_id: str | None
    reference_answer: str | None


class TraceValues(TraceContent):
    public_id: str
    project_id: int
    config_id: int
    content_sha256: str
    created_at: datetime


class TraceTagValues(TypedDict):
    trace_id: int
    trace_created_at: datetime
    tag: str


def _table(model: type[Base]) -> Table:
    table = model.__table__
    assert isinstance(table, Table)
    return table


def _chunks(values: Sequence[Any], size: int = _IN_CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def ensure_configs(session: Session, rows: Mapping[str, ConfigValues]) -> dict[str, int]:
    """Store the configurations not stored yet (`rows` keyed by content_sha256) and return the
    database id of every one of them."""
    if not rows:
        return {}
    # Sorted: concurrent transactions then take the unique-index locks in one order and cannot
    # deadlock on each other.
    ordered = [rows[sha] for sha in sorted(rows)]
    insert = dialect_insert(session)(_table(NumericalConfigRow))
    session.execute(insert.on_conflict_do_nothing(), ordered)
    ids: dict[str, int] = {}
    for chunk in _chunks(list(rows)):
        stmt = select(NumericalConfigRow.content_sha256, NumericalConfigRow.id).where(
            NumericalConfigRow.content_sha256.in_(chunk)
        )
        ids.update({sha: id_ for sha, id_ in session.execute(stmt)})
    return ids


def _insert_do_nothing(
    session: Session,
    table: Table,
    rows: Sequence[Mapping[str, object]],
    returning: Sequence[str] = (),
) -> list[tuple[Any, ...]]:
    """INSERT `rows` ... ON CONFLICT DO NOTHING in one round trip: the rows inserted.

    On PostgreSQL this is psycopg's pipelined `executemany` of one prepared single-row INSERT:
    3x faster than SQLAlchemy's multi-row VALUES rendering for 500 wide rows, most of whose
    time went into psycopg rewriting a 10,000-placeholder query string in Python. SQLite gets
    SQLAlchemy's multi-row INSERT ... RETURNING ("insertmanyvalues").
    """
    if not rows:
        return []
    if session.get_bind().dialect.name != "postgresql":
        stmt = sqlite.insert(table).on_conflict_do_nothing()
        if returning:
            with_returning = stmt.returning(*(table.c[name] for name in returning))
            return [tuple(row) for row in session.execute(with_returning, list(rows))]
        session.execute(stmt, list(rows))
        return []

    columns = list(rows[0])
    json_columns = _json_columns(table)
    values = ", ".join(f"%({c})s::json" if c in json_columns else f"%({c})s" for c in columns)
    sql = (
        f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({values}) ON CONFLICT DO NOTHING"
    )
    if returning:
        sql += f" RETURNING {', '.join(returning)}"
    params = [
        {c: orjson.dumps(row[c]).decode() if c in json_columns else row[c] for c in columns}
        for row in rows
    ]
    driver_connection = session.connection().connection.driver_connection
    assert driver_connection is not None
    cursor = driver_connection.cursor()  # psycopg, inside the session's transaction
    try:
        cursor.executemany(sql, params, returning=bool(returning))
        inserted: list[tuple[Any, ...]] = []
        if returning:
            while True:
                inserted.extend(cursor.fetchall())
                if not cursor.nextset():
                    break
        return inserted
    finally:
        cursor.close()


def insert_trace_keys(session: Session, rows: Sequence[TraceKeyValues]) -> set[str]:
    """The content_sha256 of the keys inserted (exactly the traces to store): a key whose
    content, external_id or public id is taken is skipped."""
    # Sorted by content: two batches holding the same traces in different orders (a client
    # retrying concurrently) take the unique-index locks in one order and cannot deadlock.
    ordered = sorted(rows, key=lambda row: row["content_sha256"])
    inserted = _insert_do_nothing(session, _table(TraceKey), ordered, returning=("content_sha256",))
    return {sha for (sha,) in inserted}


def insert_traces(session: Session, rows: Sequence[TraceValues]) -> dict[str, tuple[int, str]]:
    """content_sha256 -> (id, public_id) of the rows inserted (those whose keys
    `insert_trace_keys` just inserted)."""
    inserted = _insert_do_nothing(
        session, _table(Trace), rows, returning=("id", "public_id", "content_sha256")
    )
    return {sha: (id_, public_id) for id_, public_id, sha in inserted}


def insert_trace_tags(session: Session, rows: Sequence[TraceTagValues]) -> None:
    if not rows:
        return
    if session.get_bind().dialect.name == "postgresql":
        # Three narrow columns: one statement over arrays beats even a pipeline of rows.
        session.execute(
            text(
                "INSERT INTO trace_tags (trace_id, trace_created_at, tag) "
                "SELECT * FROM unnest(CAST(:trace_ids AS bigint[]),"
                " CAST(:created_ats AS timestamptz[]), CAST(:tags AS text[])) "
                "ON CONFLICT DO NOTHING"
            ),
            {
                "trace_ids": [r["trace_id"] for r in rows],
                "created_ats": [r["trace_created_at"] for r in rows],
                "tags": [r["tag"] for r in rows],
            },
        )
        return
    _insert_do_nothing(session, _table(TraceTag), rows)


class OneTraceInsert(NamedTuple):
    """What `insert_one_trace` did. `config_id` is None when the configuration is not stored
    yet (then nothing was inserted); `trace` is (id, public_id) when the trace went in, None
    when its key was taken (a repeat, an external_id in use, a concurrent twin)."""

    config_id: int | None
    trace: tuple[int, str] | None


def _json_columns(table: Table) -> frozenset[str]:
    return frozenset(c.name for c in table.c if isinstance(c.type, JSON))


_TRACE_JSON_COLUMNS: Final = _json_columns(_table(Trace))


def _typed(dialect: Dialect, table: Table, columns: Sequence[str]) -> str:
    """`CAST(%(c)s AS <type>), ...`: the parameters of an INSERT ... SELECT, typed (in a select
    list PostgreSQL would take an untyped NULL for text)."""
    types = {c: table.c[c].type.compile(dialect=dialect) for c in columns}
    return ", ".join(f"CAST(%({c})s AS {types[c]})" for c in columns)


@functools.cache
def _one_trace_sql(dialect: Dialect) -> str:
    key_columns = list(TraceKeyValues.__annotations__)
    columns = [name for name in TraceValues.__annotations__ if name != "config_id"]
    # The configuration is looked up, not inserted: the statement's snapshot could not see a
    # twin committed while an INSERT waited on it, so a new one takes the general path. A repeat
    # or a race inserts no key, hence no trace. Data-modifying WITH clauses run to completion
    # even where nothing reads them.
    sql = f"""
        WITH config AS (
            SELECT id FROM numerical_configs WHERE content_sha256 = %(config_sha256)s
        ), trace_key AS (
            INSERT INTO trace_keys ({", ".join(key_columns)})
            SELECT {_typed(dialect, _table(TraceKey), key_columns)} FROM config
            ON CONFLICT DO NOTHING
            RETURNING public_id
        ), trace AS (
            INSERT INTO traces ({", ".join(columns)}, config_id)
            SELECT {_typed(dialect, _table(Trace), columns)}, config.id FROM trace_key, config
            RETURNING id, public_id, created_at
        ), tag AS (
            INSERT INTO trace_tags (trace_id, trace_created_at, tag)
            SELECT DISTINCT trace.id, trace.created_at, tag
            FROM trace, json_array_elements_text(CAST(%(tags)s AS json)) AS tag
            ON CONFLICT DO NOTHING
        )
        SELECT (SELECT id FROM config), trace.id, trace.public_id
        FROM (SELECT 1) AS one LEFT JOIN trace ON true
    """
    return " ".join(sql.split())


def insert_one_trace(
    session: Session, config_sha256: str, row: TraceContent, key: TraceKeyValues
) -> OneTraceInsert | None:
    """Store one trace, its key and its tags in one round trip when its configuration is
    already stored: a single POST's common case. PostgreSQL only: None on SQLite, where the
    caller takes the general path. The trace gets `key`'s ids and time."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    params: dict[str, object] = {**row, **key, "config_sha256": config_sha256}
    for name in _TRACE_JSON_COLUMNS:  # as `_insert_do_nothing` sends them
        params[name] = orjson.dumps(params[name]).decode()
    driver_connection = session.connection().connection.driver_connection
    assert driver_connection is not None
    with driver_connection.cursor() as cursor:
        cursor.execute(_one_trace_sql(session.get_bind().dialect), params)
        answer = cursor.fetchone()
    assert answer is not None  # the statement always answers one row
    config_id, trace_id, public_id = answer
    trace = (trace_id, public_id) if trace_id is not None else None
    return OneTraceInsert(config_id, trace)


def public_ids_by(
    session: Session, project_id: int, column: InstrumentedAttribute[Any], values: Collection[str]
) -> dict[str, str]:
    """`column` value (`TraceKey.content_sha256` or `TraceKey.external_id`) -> public id of the
    project's trace carrying it."""
    found: dict[str, str] = {}
    for chunk in _chunks(sorted(values)):
        stmt = select(column, TraceKey.public_id).where(
            TraceKey.project_id == project_id, column.in_(chunk)
        )
        found.update({value: public_id for value, public_id in session.execute(stmt)})
    return found


def get_traces(session: Session, project_id: int, public_ids: Collection[str]) -> list[Trace]:
    """The project's traces among `public_ids`, with their configuration (any order; ids of
    other projects or unknown ids are simply absent)."""
    traces: list[Trace] = []
    for chunk in _chunks(sorted(set(public_ids))):
        stmt = select(Trace).where(Trace.project_id == project_id, Trace.public_id.in_(chunk))
        traces.extend(session.execute(stmt).scalars())
    return traces


def select_where(stmt: Select[*_Ts], project_id: int, selection: TraceSelection) -> Select[*_Ts]:
    """`stmt` narrowed to the project's traces in `selection`: the one place a selection becomes
    SQL. `stmt` must select from `traces` (an entity, its columns or `count()` with
    `select_from(Trace)`); this joins `NumericalConfigRow`, so `stmt` may select its columns
    too and must not join it itself."""
    s = selection
    where: list[ColumnElement[bool]] = [Trace.project_id == project_id]
    equal = {  # the selection's fields that name one value of a column
        Trace.model_name: s.model_name,
        Trace.weights_sha256: s.weights_sha256,
        NumericalConfigRow.public_id: s.config_id,
        NumericalConfigRow.dtype: s.dtype,
        NumericalConfigRow.lm_head_dtype: s.lm_head_dtype,
        NumericalConfigRow.attn_kernel: s.attn_kernel,
        Trace.external_id: s.external_id,
        Trace.public_id: s.public_id,
    }
    where += [column == value for column, value in equal.items() if value is not None]
    for tag in s.tags:
        where.append(
            exists().where(
                TraceTag.trace_id == Trace.id,
                TraceTag.trace_created_at == Trace.created_at,  # one partition's tags
                TraceTag.tag == tag,
            )
        )
    if s.created_after is not None:
        where.append(Trace.created_at >= s.created_after)
    if s.created_before is not None:
        where.append(Trace.created_at < s.created_before)
    if s.greedy is not None:
        # `decoding` is JSON on both databases; SQLAlchemy renders the path for each
        # (`->>` on PostgreSQL, JSON_EXTRACT on SQLite). No strategy (NULL) means greedy, as in
        # `selection.is_greedy`.
        strategy = Trace.decoding["strategy"].as_string()
        greedy = or_(strategy.is_(None), strategy == GREEDY)
        where.append(greedy if s.greedy else not_(greedy))
    return stmt.join(NumericalConfigRow, NumericalConfigRow.id == Trace.config_id).where(*where)


def select_traces(project_id: int, selection: TraceSelection) -> Select[Trace]:
    """The project's traces in `selection`, newest first, with their configuration and without
    the token arrays and texts (deferred: touching them raises). Add
    `.where(Trace.public_id < cursor)` / `.limit()`, or `.order_by(None)` for another order."""
    stmt = select(Trace).options(
        contains_eager(Trace.config), *(defer(c, raiseload=True) for c in _ARRAY_COLUMNS)
    )
    return select_where(stmt, project_id, selection).order_by(Trace.public_id.desc())


def list_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    *,
    limit: int,
    before_public_id: str | None = None,
) -> list[Trace]:
    """Up to `limit` of the project's traces in `selection`, newest first, strictly older than
    `before_public_id` when given (keyset pagination on the time-ordered public id)."""
    stmt = select_traces(project_id, selection)
    if before_public_id is not None:
        stmt = stmt.where(Trace.public_id < before_public_id)
    return list(session.execute(stmt.limit(limit)).unique().scalars())


def stored_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    public_ids: Collection[str] = (),
    *,
    limit: int | None = None,
) -> Iterator[Trace]:
    """Up to `limit` of the project's traces in `selection` (and among `public_ids` if any),
    whole, oldest first, read a chunk at a time (an export of many traces)."""
    stmt = select_where(select(Trace).options(contains_eager(Trace.config)), project_id, selection)
    if public_ids:
        stmt = stmt.where(Trace.public_id.in_(sorted(set(public_ids))))
    stmt = stmt.order_by(Trace.public_id).limit(limit).execution_options(yield_per=200)
    yield from session.execute(stmt).scalars()
