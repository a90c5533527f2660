"""Request and response bodies of `/v1/verifications` (docs/verify.md)."""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, StringConstraints

from replay_audit.formats import Device
from replay_audit.input import InputModel, UtcDatetime
from replay_audit.json_value import JsonObject
from replay_audit.output import JobRead, OutputModel
from replay_audit.traces.schemas import Tag
from replay_audit.traces.selection import TraceSelection

#: At most this many traces per verification (422 above it): the job scans every one.
MAX_VERIFICATION_TRACES: Final = 2_000
GroupBy = Literal["none", "tag", "engine", "config"]
#: A trace's public id (`tr_...`).
TraceId = Annotated[str, StringConstraints(min_length=1, max_length=40)]


class VerificationFilter(InputModel):
    """The stored traces to verify: every field given must hold (greedy and sampled traces
    alike: sampled ones are counted and set apart, not verified). `engine` is the logging
    engine's name (`config.engine.name`); `trace_ids` names the traces themselves (public ids,
    each one a trace of the project: an audit schedule verifies the traces it sampled)."""

    trace_ids: list[TraceId] | None = Field(
        default=None, min_length=1, max_length=MAX_VERIFICATION_TRACES
    )
    model_name: str | None = Field(default=None, max_length=200)
    weights_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    engine: str | None = Field(default=None, min_length=1, max_length=200)
    tag: Tag | None = None
    tags: list[Tag] | None = Field(default=None, max_length=16)
    created_after: UtcDatetime | None = None
    #: [created_after, created_before), as every filter's: an empty window selects no trace
    #: (the 422 of any filter that selects none), not a rule between two fields.
    created_before: UtcDatetime | None = None

    def to_selection(self) -> TraceSelection:
        return TraceSelection(
            model_name=self.model_name,
            weights_sha256=self.weights_sha256,
            tags=(*([self.tag] if self.tag is not None else []), *(self.tags or [])),
            created_after=self.created_after,
            created_before=self.created_before,
        )


class VerificationCreate(InputModel):
    """Verify the stored traces `filter` selects against the checkpoint they claim (found by a
    worker in its `REPLAY_AUDIT_MODEL_DIRS` by weights_sha256), one verdict per group."""

    filter: VerificationFilter
    group_by: GroupBy = "none"
    false_alarm_rate: float = Field(default=0.01, ge=1e-4, le=0.5, allow_inf_nan=False)
    #: Where the scan runs: "cpu" sends the job to the cpu queue, else the gpu queue.
    device: Device | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)


class VerificationCreated(OutputModel):
    id: str
    created: bool
    traces: int


class VerificationRead(JobRead):
    #: The report once done: `verdict`, each group's verdict, score, threshold,
    #: false_alarm_rate, tokens, tokens_needed, closest_benign, sampled traces set apart; every
    #: trace's worst tokens; the calibrations used; the scanning vs the claimed platforms.
    report: JsonObject | None
