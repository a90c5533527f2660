"""What the runs list and a run's results page can be filtered by (values the handlers build
and the repository turns into SQL)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class RunFilter:
    """Filters of the runs list. `dtype`: some target of the run has this body dtype;
    `model_name`: some trace of the run was logged by this model; `name`: the run's name
    contains this text (case-insensitive)."""

    model_name: str | None = None
    name: str | None = None
    dtype: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


@dataclass(frozen=True)
class ResultFilter:
    comparison: int | None = None
    category: str | None = None
    #: "exact", "diverged" or "failed".
    outcome: str | None = None
