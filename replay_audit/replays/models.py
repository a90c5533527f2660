"""Replay-run tables.

    replay_runs      one request: selection, targets, comparisons, status, aggregate
    replay_jobs      the queue's unit of work: a chunk of the run's traces (unique per run+chunk)
    replay_results   one row per trace x comparison (unique): the product's answer; on
                     PostgreSQL partitioned by its trace's created_at (traces/models.py)

A job writes each trace's results in their own transaction with INSERT ... ON CONFLICT DO
NOTHING on (run_id, trace_id, comparison), so a killed, retried or re-enqueued job never
duplicates a result and never leaves one half-written.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

# The tables its foreign keys name (projects, traces), in the metadata whoever imports this.
import replay_audit.auth.models
import replay_audit.traces.models  # noqa: F401
from replay_audit.db.base import Base, utcnow
from replay_audit.db.jobs import JobRow
from replay_audit.db.types import BigId, Int32Array, PackedInt32Array
from replay_audit.json_value import JsonObject, as_float, as_int
from replay_audit.replays.domain import (
    DEFAULT_CONTROL_FRACTION,
    DEFAULT_CONTROL_SEED,
    DEFAULT_FLAGGED_FRACTION,
    SCAN_FLAG_OFF,
    Comparison,
    ControlSample,
    RunTarget,
)

#: Longest run name, in characters (migration 0007's column).
MAX_RUN_NAME = 200


class ReplayRun(JobRow, Base):
    __tablename__ = "replay_runs"

    #: A name people give the run (free text, not unique); lists and titles show it, with the id.
    name: Mapped[str | None] = mapped_column(String(MAX_RUN_NAME), nullable=True)
    mode: Mapped[str] = mapped_column(String(32))
    #: Decodes compared with the logged tokens stop this many tokens after t* (the request's
    #: `decode_window`, migration 0018); NULL: decoded to eos or the budget.
    decode_window: Mapped[int | None] = mapped_column(Integer, nullable=True)
    compare: Mapped[str] = mapped_column(String(16))
    #: Resolved targets (index = position); a `self` target has {"self": true}.
    targets: Mapped[list[JsonObject]] = mapped_column(JSON)
    #: [{"index", "a", "b"}]; a = "logged" or a target index, b = a target index.
    comparisons: Mapped[list[JsonObject]] = mapped_column(JSON)
    n_traces: Mapped[int] = mapped_column(Integer)
    n_items: Mapped[int] = mapped_column(Integer)
    schedule_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    #: The run's statistics (`stats.report.RunStatistics` JSON), stored when the run finishes.
    aggregate: Mapped[JsonObject | None] = mapped_column(JSON, nullable=True)

    @property
    def display_name(self) -> str:
        """What a list or title shows: the name when there is one, else the public id."""
        return self.name or self.public_id

    @property
    def run_targets(self) -> tuple[RunTarget, ...]:
        """The stored targets as domain values."""
        return tuple(RunTarget.from_json(t) for t in self.targets)

    @property
    def run_comparisons(self) -> tuple[Comparison, ...]:
        return tuple(Comparison.from_json(c) for c in self.comparisons)

    @property
    def control_sample(self) -> ControlSample | None:
        """The control sample of a scan-then-decode run (as its request recorded it; the
        defaults for a run whose request predates the fields), None in the other modes."""
        if self.mode != "scan_then_decode":
            return None
        fraction = self.request.get("control_fraction")
        seed = self.request.get("control_seed")
        flag = self.request.get("scan_flag_ulps")
        flagged = self.request.get("flagged_fraction")
        return ControlSample(
            DEFAULT_CONTROL_FRACTION if fraction is None else as_float(fraction),
            DEFAULT_CONTROL_SEED if seed is None else as_int(seed),
            # A run stored before near-tie flagging had none: off.
            SCAN_FLAG_OFF if flag is None else as_float(flag),
            # A run stored before the flagged sample decoded every flagged trace.
            DEFAULT_FLAGGED_FRACTION if flagged is None else as_float(flagged),
        )


class ReplayJob(Base):
    __tablename__ = "replay_jobs"
    __table_args__ = (
        UniqueConstraint("run_id", "chunk"),
        CheckConstraint("status IN ('queued', 'running', 'done', 'failed')", name="status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("replay_runs.id", ondelete="CASCADE"), index=True
    )
    chunk: Mapped[int] = mapped_column(Integer)
    #: The queue of its route (`queue.route.Route.queue`: `gpu`, `gpu:a10g`, `gpu:a10g:tp2`).
    queue: Mapped[str] = mapped_column(String(64))
    #: Internal trace ids (traces.id) this job replays, in order.
    trace_ids: Mapped[list[int]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Until when the job running it holds the row (`db.job_row.leased`, migration 0021);
    #: None: no job.
    lease_until: Mapped[datetime | None] = mapped_column(nullable=True)
    enqueued_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ReplayResult(Base):
    __tablename__ = "replay_results"
    __table_args__ = (
        # The trace's created_at is in the key because it is the partition key on PostgreSQL
        # (a trace's id fixes it, so the key means what (run_id, trace_id, comparison) did).
        UniqueConstraint("run_id", "trace_id", "trace_created_at", "comparison"),
        ForeignKeyConstraint(
            ["trace_id", "trace_created_at"],
            ["traces.id", "traces.created_at"],
            ondelete="CASCADE",
            # A trace's created_at never changes in the product; tests that move traces in
            # time carry their tags and results along.
            onupdate="CASCADE",
        ),
        CheckConstraint("status IN ('ok', 'failed')", name="status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("replay_runs.id", ondelete="CASCADE"), index=True
    )
    trace_id: Mapped[int] = mapped_column(BigId, index=True)
    #: The trace's `created_at`: on PostgreSQL the partition key (a result sits in the week
    #: partition of its trace, so retention drops them together) and half of the key to it.
    trace_created_at: Mapped[datetime] = mapped_column()
    comparison: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    exact_match: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    first_divergence_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    category: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    #: Each arm's top-2 margin at t* (absolute, in ulps of its lm_head format), and where arm
    #: A's came from (the logged top-k, a re-run here, its own decode here, or unavailable).
    margin_a: Mapped[float | None] = mapped_column(Float, nullable=True)
    margin_a_ulps: Mapped[float | None] = mapped_column(Float, nullable=True)
    margin_a_source: Mapped[str | None] = mapped_column(String(32), nullable=True)
    margin_b: Mapped[float | None] = mapped_column(Float, nullable=True)
    margin_b_ulps: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Arm B's gate firings and replayed steps (the result's `gate_triggers`), and arm A's
    #: where arm A was run here too (both-arms comparisons; None against the logged tokens).
    gate_triggers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    n_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gate_triggers_a: Mapped[int | None] = mapped_column(Integer, nullable=True)
    n_steps_a: Mapped[int | None] = mapped_column(Integer, nullable=True)
    trigger_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    mean_gap: Mapped[float | None] = mapped_column(Float, nullable=True)
    tie: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    cascade_length: Mapped[int | None] = mapped_column(Integer, nullable=True)
    length_difference: Mapped[int | None] = mapped_column(Integer, nullable=True)
    semantic_agree: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    #: Extracted final answers (arm A, arm B) and the extractor's name, when one ran: columns,
    #: not detail JSON, so task accuracy over a large run reads a few bytes per row.
    answer_extractor: Mapped[str | None] = mapped_column(String(32), nullable=True)
    answer_a: Mapped[str | None] = mapped_column(Text, nullable=True)
    answer_b: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Replayed output of arm B (and of arm A when both arms were run by us).
    output_b: Mapped[Int32Array | None] = mapped_column(PackedInt32Array, nullable=True)
    output_a: Mapped[Int32Array | None] = mapped_column(PackedInt32Array, nullable=True)
    #: What ran for each arm (`domain.ResolvedArm` as JSON text), NULL for the logged tokens
    #: and for rows of releases before it was recorded: columns, so the run page counts what
    #: ran per comparison with a GROUP BY.
    resolved_a: Mapped[str | None] = mapped_column(Text, nullable=True)
    resolved_b: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Everything else of the outcome (`replays.results`): per arm its environment, target,
    #: margin track and text; the single-step re-run; the semantic answers.
    detail: Mapped[JsonObject] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: What a scan-then-decode run did with the trace (`formats.Screen`: flagged, control,
    #: scanned), NULL in the other modes; a scanned result has exact_match and category NULL.
    screen: Mapped[str | None] = mapped_column(String(16), nullable=True)
    #: The decode stopped at the run's `decode_window` tokens after t*: `output_b` is a prefix
    #: of the whole continuation, and what reads past t* (cascade, length difference, answers)
    #: is NULL. NULL or false: decoded to eos or the budget.
    window_cut: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    #: What a comparison with the logged tokens was judged against (`formats.Baseline`):
    #: "logged" (NULL in rows written before reproduction came first), "reproduced" or
    #: "replayed" (arm A is then the logged configuration replayed here).
    baseline: Mapped[str | None] = mapped_column(String(16), nullable=True)
