"""Which of a project's traces a request means: one value for every surface that selects traces
(the listing, `replays.schemas.TraceFilter`, `audits.schemas.Selection`: each maps its own public
field names to it at its edge); `traces.repository.select_where` turns it into SQL, once. Pure.

Only greedy generations replay (DESIGN.md), so a replay filter or an audit selects greedy traces
and skips the others instead of failing on them; the listing shows all unless asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

#: The decoding strategy that replays: `decoding.strategy` of a replayable trace.
GREEDY: Final = "greedy"


def is_greedy(decoding: Mapping[str, Any]) -> bool:
    """Whether a stored `decoding` JSON is greedy (no strategy given counts as greedy)."""
    return decoding.get("strategy", GREEDY) in (GREEDY, None)


def _utc(value: datetime | None) -> datetime | None:
    # A time without a zone means UTC on every surface (the database stores UTC only).
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


@dataclass(frozen=True)
class TraceSelection:
    """A set of one project's traces: every condition given must hold, None (or no tags) means
    "any". The trace carries all `tags`; times select [created_after, created_before);
    `lm_head_dtype` is the effective head dtype (`NumericalConfigRow.lm_head_dtype`)."""

    model_name: str | None = None
    weights_sha256: str | None = None
    #: A numerical configuration's public id (`cfg_...`).
    config_id: str | None = None
    #: The body dtype, `config.dtype`.
    dtype: str | None = None
    lm_head_dtype: str | None = None
    attn_kernel: str | None = None
    tags: tuple[str, ...] = field(default=())
    external_id: str | None = None
    #: One trace's public id (`tr_...`): the web UI's trace search.
    public_id: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    greedy: bool | None = None

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__, once, at construction.
        object.__setattr__(self, "tags", tuple(dict.fromkeys(self.tags)))
        object.__setattr__(self, "created_after", _utc(self.created_after))
        object.__setattr__(self, "created_before", _utc(self.created_before))
