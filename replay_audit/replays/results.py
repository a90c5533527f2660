"""A replay result between its three forms, each mapping written once:

    ReplayOutcome (domain)  --result_values-->  replay_results row (columns + detail JSON)
    replay_results row      --result_read---->  ReplayResultRead (API, export, UI, CLI output)
    replay_results row      --figures-------->  ResultFigures (the statistics builder's input)
    result JSON             --figures_from_json-> ResultFigures (`replay --resume` reading its file)

The CLI, which stores nothing, builds the same row object in memory (`ReplayResult(**values)`)
and goes through the same two mappings, so its output file and summary say what the API would.
One layout: rows of earlier 0.x releases are converted by a migration, not read here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Required, TypedDict

import numpy as np
import numpy.typing as npt

from replay_audit.db.base import utcnow
from replay_audit.diff.pieces import to_json
from replay_audit.formats import (
    EXTRA_TOKEN_IDS_SOURCE,
    Baseline,
    Category,
    MarginSource,
    ResultStatus,
    Screen,
)
from replay_audit.json_value import JsonObject
from replay_audit.replays.domain import ArmOutcome, ReplayOutcome
from replay_audit.replays.schemas import ReplayResultRead
from replay_audit.stats.report import ResultFigures

#: Longest error text stored with a failed result.
MAX_ERROR_CHARS = 4000


def _plain(x: Any) -> Any:
    """JSON-safe plain types: a dataclass as its fields (what `dataclasses.asdict` gives, read
    once instead of deep-copied first), numpy scalars to Python, non-finite floats to None."""
    kind = type(x)
    if kind is str or kind is int or kind is bool or x is None:
        return x
    if kind is float:
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _arm_detail(arm: ArmOutcome) -> JsonObject:
    """What the detail JSON keeps of an arm (its output, gate triggers and steps live in
    columns). The per-step lists are plain already (the pipeline rounds the margins to finite
    floats or None): not walked again. The target is its `to_dict()` (`asdict`), read by
    `_plain` straight from the dataclass."""
    detail: JsonObject = _plain(
        {
            "target": arm.target,
            "gate_fired_at_divergence": arm.gate_fired_at_divergence,
            "mean_gap": arm.mean_gap,
            "changed_steps": arm.changed_steps,
            "environment": arm.environment,
            "text": arm.text,
        }
    )
    detail["margins"] = list(arm.margins) if arm.margins is not None else None
    steps = arm.gate_fired_steps
    detail["gate_fired_steps"] = list(steps) if steps is not None else None
    if arm.pieces is not None:
        detail["pieces"] = to_json(arm.pieces)  # type: ignore[assignment]
    return detail


class ResultRow(TypedDict, total=False):
    """A `replay_results` row's values (without run, trace and time): what `result_values`
    and `failed_values` give and `repository.insert_results_of` writes."""

    comparison: Required[int]
    status: Required[ResultStatus]
    error: str | None
    exact_match: bool | None
    first_divergence_step: int | None
    category: Category | None
    margin_a: float | None
    margin_a_ulps: float | None
    margin_a_source: MarginSource | None
    margin_b: float | None
    margin_b_ulps: float | None
    gate_triggers: int | None
    n_steps: int | None
    trigger_rate: float | None
    mean_gap: float | None
    gate_triggers_a: int | None
    n_steps_a: int | None
    tie: bool
    cascade_length: int | None
    length_difference: int | None
    semantic_agree: bool | None
    answer_extractor: str | None
    answer_a: str | None
    answer_b: str | None
    output_b: npt.NDArray[np.int32] | None
    output_a: npt.NDArray[np.int32] | None
    resolved_a: str | None
    resolved_b: str | None
    detail: Required[dict[str, object]]
    screen: Screen | None
    window_cut: bool
    baseline: Baseline


def result_values(comparison: int, outcome: ReplayOutcome) -> ResultRow:
    """The `replay_results` values of one outcome (without run, trace and time)."""
    a, b = outcome.a, outcome.b
    semantic, single = outcome.semantic, outcome.single_step
    detail: dict[str, object] = {
        "mode": outcome.mode,
        "external_id": outcome.external_id,
        # Non-finite margins stored as None (`_plain`), as in the margin columns.
        "single_step": _plain(single),
        "semantic": semantic.to_dict() if semantic is not None else None,
        "arms": {"a": _arm_detail(a), "b": _arm_detail(b)},
    }
    return {
        "comparison": comparison,
        "status": "ok",
        "error": None,
        "exact_match": outcome.exact_match,
        "first_divergence_step": outcome.first_divergence_step,
        "category": outcome.category,
        "margin_a": _plain(a.margin.abs) if a.margin else None,
        "margin_a_ulps": _plain(a.margin.ulps) if a.margin else None,
        "margin_a_source": a.margin.source if a.margin else None,
        "margin_b": _plain(b.margin.abs) if b.margin else None,
        "margin_b_ulps": _plain(b.margin.ulps) if b.margin else None,
        "gate_triggers": b.gate_triggers,
        "n_steps": b.steps,
        "trigger_rate": _plain(b.trigger_rate),
        "mean_gap": _plain(b.mean_gap),
        "gate_triggers_a": a.gate_triggers,
        "n_steps_a": a.steps,
        "tie": outcome.tie,
        "cascade_length": outcome.cascade_length,
        "length_difference": outcome.length_difference,
        "semantic_agree": semantic.agree if semantic is not None else None,
        "answer_extractor": semantic.extractor if semantic is not None else None,
        "answer_a": semantic.answer_a if semantic is not None else None,
        "answer_b": semantic.answer_b if semantic is not None else None,
        "output_b": _tokens(b),
        "output_a": _tokens(a),
        "resolved_a": _resolved(a),
        "resolved_b": _resolved(b),
        "detail": detail,
        "screen": outcome.screen,
        "window_cut": outcome.window_cut,
        "baseline": outcome.baseline,
    }


def _resolved(arm: ArmOutcome) -> str | None:
    """The arm's `ResolvedArm.to_json()` (`asdict`) as JSON text, read by `_plain` straight
    from the dataclass."""
    return json.dumps(_plain(arm.resolved)) if arm.resolved is not None else None


def _tokens(arm: ArmOutcome) -> npt.NDArray[np.int32] | None:
    ids = arm.output_token_ids
    return np.asarray(ids, np.int32) if ids is not None else None


def failed_values(comparison: int, reason: str) -> ResultRow:
    """The values of a result that could not be computed, saying why."""
    return {
        "comparison": comparison,
        "status": "failed",
        "error": reason[:MAX_ERROR_CHARS],
        "detail": {},
    }


def _arm_json(
    d: Mapping[str, Any],
    output: np.ndarray | None,
    resolved: str | None,
    gate_triggers: int | None,
    steps: int | None,
    mean_gap: float | None,
) -> JsonObject:
    """An arm as `ArmRead` JSON."""
    return {
        "target": d.get("target"),
        "resolved": json.loads(resolved) if resolved is not None else None,
        "gate_fired_at_divergence": d.get("gate_fired_at_divergence"),
        "output_token_ids": output.tolist() if output is not None else None,
        "gate_triggers": gate_triggers,
        "steps": steps,
        "trigger_rate": gate_triggers / steps if gate_triggers is not None and steps else None,
        "mean_gap": mean_gap if mean_gap is not None else d.get("mean_gap"),
        "changed_steps": d.get("changed_steps"),
        "gate_fired_steps": d.get("gate_fired_steps"),
        "margins": d.get("margins"),
        "environment": d.get("environment"),
        "text": d.get("text"),
        "token_pieces": d.get("pieces"),
    }


def result_json(
    row: Any,
    trace_public_id: str,
    run_public_id: str,
    *,
    engine_reproduced: bool | None = None,
    token_ids_source: str | None = None,
) -> JsonObject:
    """A stored result as the API's JSON (`ReplayResultRead`; times as datetimes), built
    without a model: the export streams it for every row. `row` is a `ReplayResult` or a row of
    the same columns; `engine_reproduced` is the outcome of the run's engine-reproduction check
    on the trace (see `statistics.engine_reproduced`), `token_ids_source` where the trace's
    ids come from (`token_ids_source`)."""
    detail = dict(row.detail or {})
    arms = detail.get("arms") or {}
    ok = row.status == "ok"
    a, b = arms.get("a") or {}, arms.get("b") or {}
    arm_a = _arm_json(a, row.output_a, row.resolved_a, row.gate_triggers_a, row.n_steps_a, None)
    arm_b = _arm_json(b, row.output_b, row.resolved_b, row.gate_triggers, row.n_steps, row.mean_gap)
    margins = None
    if ok and row.first_divergence_step is not None:
        source_a = row.margin_a_source or "unavailable"
        # A scan's margin at t*, also where scan-then-decode kept a flagged trace's scan.
        scanned = detail.get("mode") == "scan" or row.screen == "flagged_scanned"
        source_b = "scan" if scanned else "decode"
        margins = {
            "a": {"abs": row.margin_a, "ulps": row.margin_a_ulps, "source": source_a},
            "b": {"abs": row.margin_b, "ulps": row.margin_b_ulps, "source": source_b},
        }
    return {
        "run_id": run_public_id,
        "trace_id": trace_public_id,
        "comparison": row.comparison,
        "status": row.status,
        "error": row.error,
        "exact_match": None if row.exact_match is None else bool(row.exact_match),
        "first_divergence_step": row.first_divergence_step,
        "margin_at_divergence": margins,
        "category": row.category,
        "gate_triggers": row.gate_triggers,
        "trigger_rate": row.trigger_rate,
        "mean_gap": row.mean_gap,
        "tie": None if row.tie is None else bool(row.tie),
        "cascade_length": row.cascade_length,
        "length_difference": row.length_difference,
        "mode": detail.get("mode"),
        "screen": row.screen,
        "window_cut": bool(row.window_cut),
        "baseline": row.baseline or "logged",
        "arms": {"a": arm_a, "b": arm_b} if ok else None,
        "single_step": detail.get("single_step"),
        "semantic": detail.get("semantic"),
        "engine_reproduced": engine_reproduced,
        "token_ids_source": token_ids_source,
        "created_at": row.created_at or utcnow(),
    }


def result_read(
    row: Any,
    trace_public_id: str,
    run_public_id: str,
    *,
    engine_reproduced: bool | None = None,
    token_ids_source: str | None = None,
) -> ReplayResultRead:
    """The API view of a stored result (also what the UI and the CLI show): `result_json`,
    validated into its model."""
    data = result_json(
        row,
        trace_public_id,
        run_public_id,
        engine_reproduced=engine_reproduced,
        token_ids_source=token_ids_source,
    )
    return ReplayResultRead.model_validate(data)


def token_ids_source(config: Mapping[str, Any]) -> str | None:
    """Where a trace's ids come from, from its configuration (a `NumericalConfig` as JSON):
    None where they were logged (every trace but an import's that read them from text)."""
    extras = config.get("extras")
    source = extras.get(EXTRA_TOKEN_IDS_SOURCE) if isinstance(extras, Mapping) else None
    return None if source in (None, "logged") else str(source)


#: The result columns the statistics read as they are stored (`figures`).
FIGURE_COLUMNS = tuple(
    f for f in ResultFigures._fields if f not in ("trace_public_id", "external_id")
)


def figures(row: Any, trace_public_id: str, external_id: str | None) -> ResultFigures:
    """The statistics' view of a result row (an ORM row or a row of the same columns)."""
    values = {f: getattr(row, f) for f in FIGURE_COLUMNS}
    exact = values["exact_match"]
    return ResultFigures(
        **values | {"exact_match": None if exact is None else bool(exact)},
        trace_public_id=trace_public_id,
        external_id=external_id,
    )


def figures_from_json(
    data: Mapping[str, Any], trace_id: int, external_id: str | None
) -> ResultFigures:
    """The statistics' view of a result in its API JSON form (`result_json`, as `replay --out`
    writes it): how `replay --resume` counts the results an earlier run wrote."""
    margins = data.get("margin_at_divergence") or {}
    arms = data.get("arms") or {}
    a, b = arms.get("a") or {}, arms.get("b") or {}
    semantic = data.get("semantic") or {}
    return ResultFigures(
        trace_id=trace_id,
        trace_public_id=str(data["trace_id"]),
        external_id=external_id,
        status=str(data["status"]),
        exact_match=data.get("exact_match"),
        first_divergence_step=data.get("first_divergence_step"),
        category=data.get("category"),
        margin_a=(margins.get("a") or {}).get("abs"),
        margin_a_ulps=(margins.get("a") or {}).get("ulps"),
        margin_b=(margins.get("b") or {}).get("abs"),
        margin_b_ulps=(margins.get("b") or {}).get("ulps"),
        gate_triggers=data.get("gate_triggers"),
        n_steps=b.get("steps"),
        mean_gap=data.get("mean_gap"),
        gate_triggers_a=a.get("gate_triggers"),
        n_steps_a=a.get("steps"),
        length_difference=data.get("length_difference"),
        answer_extractor=semantic.get("extractor"),
        answer_a=semantic.get("answer_a"),
        answer_b=semantic.get("answer_b"),
        screen=data.get("screen"),
        window_cut=data.get("window_cut"),
        baseline=data.get("baseline") or "logged",
    )
