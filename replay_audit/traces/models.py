"""Tables: numerical configurations (stored once per distinct content), traces, trace tags, and
the trace keys that make ingest idempotent.

Partitioning (PostgreSQL, migration 0010, `replay_audit.db.partition`). `traces` is range
partitioned by `created_at` in weeks; `trace_tags` and `replay_results` by their trace's
`created_at` (`trace_created_at`), so a trace, its tags and its results always sit in partitions
of the same week and retention drops the three together. PostgreSQL requires every unique key of
a partitioned table to contain the partition key: there the primary keys are (id, created_at)
and (.., trace_created_at, ..), and the foreign keys to a trace name both columns. A unique key
across partitions (one content per project, one external_id per project, one public id) cannot
live on `traces` at all, so it lives in `trace_keys`, a small table that is not partitioned.
SQLite has no partitions and keeps its original keys (the objects marked `SQLITE_ONLY`).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from replay_audit.auth.models import Project
from replay_audit.db.base import SQLITE_ONLY, Base, utcnow
from replay_audit.db.types import (
    BigId,
    Float32Array,
    Int32Array,
    PackedFloat32Array,
    PackedInt32Array,
)
from replay_audit.json_value import JsonObject


class NumericalConfigRow(Base):
    """One distinct numerical configuration, shared by every trace that ran in it: `config_json`
    is `service.canonical_config`'s JSON, a few fields are columns for filtering."""

    __tablename__ = "numerical_configs"

    id: Mapped[int] = mapped_column(primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    content_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    config_json: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str] = mapped_column(String(16))
    #: The effective lm_head dtype (the body dtype when the config leaves it unset).
    lm_head_dtype: Mapped[str] = mapped_column(String(16))
    attn_kernel: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(16))
    gpu_name: Mapped[str | None] = mapped_column(String(200))
    gpu_sm: Mapped[str | None] = mapped_column(String(8))
    #: NULL where the source did not say it (imports).
    batch_size: Mapped[int | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Trace(Base):
    """One logged greedy generation. Token arrays are packed int32, logits packed float32.
    The key is `id` here, (id, created_at) on PostgreSQL (autogenerate compares no primary
    keys)."""

    __tablename__ = "traces"
    __table_args__ = (
        # SQLite only: there these still back `trace_keys` (PostgreSQL cannot have them on a
        # partitioned table; idempotent ingest rests on `trace_keys` on both).
        UniqueConstraint("project_id", "content_sha256", info=SQLITE_ONLY),
        UniqueConstraint("project_id", "external_id", info=SQLITE_ONLY),
        UniqueConstraint("public_id", info=SQLITE_ONLY),
        # The parent key of the (trace_id, trace_created_at) foreign keys: SQLite wants a
        # unique index on exactly those columns; PostgreSQL's primary key is that.
        Index(None, "id", "created_at", unique=True, info=SQLITE_ONLY),
        Index(None, "project_id", "public_id"),
        Index(None, "project_id", "created_at"),
        Index(None, "project_id", "model_name"),
        Index(None, "project_id", "weights_sha256"),
        Index(None, "project_id", "external_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40))
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    config_id: Mapped[int] = mapped_column(ForeignKey("numerical_configs.id"), index=True)
    model_name: Mapped[str] = mapped_column(String(200))
    model_revision: Mapped[str | None] = mapped_column(String(200))
    weights_sha256: Mapped[str] = mapped_column(String(64))
    vocab_size: Mapped[int] = mapped_column()
    decoding: Mapped[JsonObject] = mapped_column(JSON)
    prompt_token_ids: Mapped[Int32Array] = mapped_column(PackedInt32Array())
    output_token_ids: Mapped[Int32Array] = mapped_column(PackedInt32Array())
    n_prompt_tokens: Mapped[int] = mapped_column()
    n_output_tokens: Mapped[int] = mapped_column()
    #: k of the logged per-step top-k; None when the trace carries none.
    top_k: Mapped[int | None] = mapped_column()
    #: Row-major (step, rank) arrays of n_output_tokens * top_k values.
    top_k_ids: Mapped[Int32Array | None] = mapped_column(PackedInt32Array())
    top_k_logits: Mapped[Float32Array | None] = mapped_column(PackedFloat32Array())
    prompt_text: Mapped[str | None] = mapped_column(Text)
    #: A chat prompt's messages ([{role, content}]); None for a plain text prompt.
    prompt_messages: Mapped[list[dict[str, str]] | None] = mapped_column(JSON, nullable=True)
    output_text: Mapped[str | None] = mapped_column(Text)
    #: Each output token's piece (`diff.pieces` stored form: a string, or a list of byte values
    #: where the token's bytes are not text alone); None when the producer had no tokenizer.
    output_token_pieces: Mapped[list[str | list[int]] | None] = mapped_column(JSON, nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON)
    external_id: Mapped[str | None] = mapped_column(String(200))
    reference_answer: Mapped[str | None] = mapped_column(Text)
    content_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    config: Mapped[NumericalConfigRow] = relationship(lazy="joined", innerjoin=True)
    project: Mapped[Project] = relationship(lazy="joined", innerjoin=True)


class TraceTag(Base):
    """One tag of one trace: how `GET /v1/traces?tag=` filters on both databases. On
    PostgreSQL partitioned with its trace (primary key (trace_id, trace_created_at, tag))."""

    __tablename__ = "trace_tags"
    __table_args__ = (
        ForeignKeyConstraint(
            ["trace_id", "trace_created_at"],
            ["traces.id", "traces.created_at"],
            ondelete="CASCADE",
            # A trace's created_at never changes in the product; tests that move traces in
            # time carry their tags and results along.
            onupdate="CASCADE",
        ),
        Index(None, "tag", "trace_id"),
    )

    trace_id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: The trace's `created_at`: the partition key, and half of the key to the trace.
    trace_created_at: Mapped[datetime] = mapped_column()


class TraceKey(Base):
    """The unique keys of one stored trace (module docstring). Ingest inserts a trace's key first
    and stores the trace only if its key went in, in the same transaction; retention deletes
    the keys of the traces it deletes, so a pruned trace may be sent again."""

    __tablename__ = "trace_keys"
    __table_args__ = (
        UniqueConstraint("project_id", "content_sha256"),
        UniqueConstraint("project_id", "external_id"),
        Index(None, "created_at"),
    )

    #: The trace's public id (unique across partitions here).
    public_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    content_sha256: Mapped[str] = mapped_column(String(64))
    external_id: Mapped[str | None] = mapped_column(String(200))
    #: The trace's `created_at` (retention deletes keys by it).
    created_at: Mapped[datetime] = mapped_column()
