"""Tables: numerical configurations (stored once per distinct content), traces, trace tags."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from replay_audit.db.base import Base, utcnow
from replay_audit.db.types import Float32Array, Int32Array, PackedFloat32Array, PackedInt32Array

if TYPE_CHECKING:
    from replay_audit.auth.models import Project

#: 64-bit keys on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid).
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class NumericalConfigRow(Base):
    """One distinct numerical configuration (`schemas.NumericalConfig`), shared by every trace
    that ran in it. `config_json` is the canonical JSON (sorted keys, defaults filled in) whose
    sha256 is `content_sha256`; a few fields are promoted to columns for filtering."""

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
    batch_size: Mapped[int] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Trace(Base):
    """One logged greedy generation. Token arrays are packed int32, logits packed float32."""

    __tablename__ = "traces"
    __table_args__ = (
        # Idempotent ingest rests on these two, not on a check-then-insert.
        UniqueConstraint("project_id", "content_sha256"),
        UniqueConstraint("project_id", "external_id"),
        Index(None, "project_id", "public_id"),
        Index(None, "project_id", "created_at"),
        Index(None, "project_id", "model_name"),
        Index(None, "project_id", "weights_sha256"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    config_id: Mapped[int] = mapped_column(ForeignKey("numerical_configs.id"), index=True)
    model_name: Mapped[str] = mapped_column(String(200))
    model_revision: Mapped[str | None] = mapped_column(String(200))
    weights_sha256: Mapped[str] = mapped_column(String(64))
    vocab_size: Mapped[int] = mapped_column()
    decoding: Mapped[dict[str, Any]] = mapped_column(JSON)
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
    """One tag of one trace: how `GET /v1/traces?tag=` filters on both databases."""

    __tablename__ = "trace_tags"
    __table_args__ = (Index(None, "tag", "trace_id"),)

    trace_id: Mapped[int] = mapped_column(
        BigIntPK, ForeignKey("traces.id", ondelete="CASCADE"), primary_key=True
    )
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)
