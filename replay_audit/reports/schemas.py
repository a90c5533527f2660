"""What a report says: `GET /v1/replays/{id}/report` returns `RunReport`, the web UI renders
the same objects, so the page and the API can never show different numbers. Its parts are the
statistics builder's types (`replay_audit.stats.report`), defined there once.

Every rate comes with its interval: proportions (EAR, SAR, category shares, task accuracy) with
their Wilson 95% interval, lifts with a seeded paired-bootstrap interval and the exact McNemar
p-value, non-inferiority with its TOST interval and p-value.
"""

from __future__ import annotations

from datetime import datetime

from replay_audit.output import StoredModel
from replay_audit.stats.report import (
    AccuracyReport,
    ComparisonReport,
    EngineReproduction,
    LiftReport,
)


class RunReport(StoredModel):
    """A run's statistics. `partial`: the run is not finished; numbers cover the results
    stored so far."""

    run_id: str
    status: str
    partial: bool
    n_traces: int
    n_results: int
    comparisons: list[ComparisonReport]
    #: Every treatment against comparison 0 (the baseline), as the run's statistics have them.
    lifts: list[LiftReport]
    #: The pair asked for (`?a=&b=`), if any.
    pair: LiftReport | None
    accuracy: AccuracyReport | None
    #: The engine-reproduction check of a run over traces logged by another engine.
    engine_reproduction: EngineReproduction | None = None


class RunComparisonReport(StoredModel):
    """Two runs side by side, and one comparison of each paired by trace."""

    run_a: RunReport
    run_b: RunReport
    pair: LiftReport
    common_traces: int


class RunSummaryRead(StoredModel):
    """One run of `GET /v1/replays`: what the runs list shows."""

    id: str
    name: str | None
    #: queued, running, done or failed.
    status: str
    created_at: datetime
    finished_at: datetime | None
    n_traces: int
    #: Model names of the run's traces.
    models: list[str]
    #: Each target's label, in target order.
    targets: list[str]
    schedule_id: str | None


class RunList(StoredModel):
    """One page of `GET /v1/replays`, newest first; pass `next_cursor` back as `cursor`."""

    items: list[RunSummaryRead]
    next_cursor: str | None
