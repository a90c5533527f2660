"""Exports of a run's results: CSV (flat summary columns) and JSONL (the same fields typed, plus
the result as `GET /v1/replays/{id}/results` gives it: both arms, margins, single step, answers,
token ids), one row per trace x comparison, streamed.

The stream reads the results in keyset batches, each in its own short read-only transaction,
so a 10,000-trace run is never held in memory and a slow client holds no database lock. A run
still replaying exports the results stored so far.

CSV cells a user typed (external ids, tags, model names, error messages) that start with `=`,
`+`, `-`, `@`, a tab or a carriage return are prefixed with `'`, so a spreadsheet does not run
them as formulas (OWASP "CSV injection"); JSONL carries them unchanged.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal

import orjson
from sqlalchemy.orm import Session, sessionmaker

from replay_audit.db.unit_of_work import unit_of_work
from replay_audit.replays.models import ReplayRun
from replay_audit.replays.results import result_json, token_ids_source
from replay_audit.replays.statistics import comparison_mode
from replay_audit.reports import repository

ExportFormat = Literal["csv", "jsonl"]

#: Columns of the CSV, in order (the JSONL objects have the same keys, and more).
EXPORT_FIELDS: Final = (
    "run_id",
    "trace_id",
    "external_id",
    "model_name",
    "tags",
    "has_reference_answer",
    "comparison",
    "arm_a",
    "arm_b",
    "status",
    "error",
    "exact_match",
    "first_divergence_step",
    "category",
    "margin_logged",
    "margin_logged_ulps",
    "margin_logged_source",
    "margin_replay",
    "margin_replay_ulps",
    "tie",
    "gate_triggers",
    "n_steps",
    "trigger_rate",
    "mean_gap",
    "cascade_length",
    "length_difference",
    "semantic_agree",
    "created_at",
    # Added in this release, after the columns of earlier ones (so readers by position keep
    # working). margin_logged*/margin_replay* above are arm A's and arm B's margins under their
    # earlier, deprecated names (arm A was called "logged" also when it was a target).
    "margin_a",
    "margin_a_ulps",
    "margin_a_source",
    "margin_b",
    "margin_b_ulps",
    "gate_triggers_a",
    "n_steps_a",
    # scan_then_decode: flagged, control or scanned (only scanned: exact_match empty).
    "screen",
    # Arm A's gate trigger rate where arm A ran here (both arms); the mode the result was
    # produced in (a scan has no replay text: semantic_agree empty).
    "trigger_rate_a",
    "mode",
    # Where the trace's token ids come from (`formats.TokenIdsSource`: pieces or retokenized
    # for an import that read them from text; empty: logged).
    "token_ids_source",
    # The decode stopped at the run's decode window after t*: the replay output is a prefix
    # (cascade_length, length_difference and semantic_agree empty).
    "window_cut",
    # What the comparison was judged against (`formats.Baseline`): the logged tokens, or the
    # logged configuration replayed here for a trace that did not reproduce in it
    # ("reproduced") or that an engine this service cannot run logged ("replayed").
    "baseline",
)
MEDIA_TYPES: Final[dict[str, str]] = {
    "csv": "text/csv; charset=utf-8",
    "jsonl": "application/x-ndjson",
}
#: Results per database round trip.
BATCH: Final = 1000
_FORMULA_START: Final = ("=", "+", "-", "@", "\t", "\r")
_USER_TEXT: Final = ("external_id", "model_name", "tags", "error")


def _arm(value: Any) -> str:
    return "logged" if value == "logged" else f"T{value}"


def record(
    run: ReplayRun, row: Mapping[str, Any], *, full: bool, ids_source: str | None = None
) -> dict[str, Any]:
    """One exported result as typed JSON values (EXPORT_FIELDS, plus detail and token ids when
    `full`); `ids_source` is where its trace's ids come from (`results.token_ids_source`)."""
    index = int(row["comparison"])
    comp = run.comparisons[index]
    mode = comparison_mode(run, index)
    created = row["created_at"]
    triggers_a, steps_a = row["gate_triggers_a"], row["n_steps_a"]
    out: dict[str, Any] = {
        "run_id": run.public_id,
        "trace_id": row["public_id"],
        "external_id": row["external_id"],
        "model_name": row["model_name"],
        "tags": list(row["tags"] or []),
        "has_reference_answer": bool(row["has_reference_answer"]),
        "comparison": index,
        "arm_a": _arm(comp["a"]),
        "arm_b": _arm(comp["b"]),
        "status": row["status"],
        "error": row["error"],
        "exact_match": row["exact_match"],
        "first_divergence_step": row["first_divergence_step"],
        "category": row["category"],
        "margin_a": row["margin_a"],
        "margin_a_ulps": row["margin_a_ulps"],
        "margin_a_source": row["margin_a_source"],
        "margin_b": row["margin_b"],
        "margin_b_ulps": row["margin_b_ulps"],
        "tie": row["tie"],
        "gate_triggers": row["gate_triggers"],
        "n_steps": row["n_steps"],
        "gate_triggers_a": row["gate_triggers_a"],
        "n_steps_a": row["n_steps_a"],
        "trigger_rate": row["trigger_rate"],
        "trigger_rate_a": triggers_a / steps_a if triggers_a is not None and steps_a else None,
        "mean_gap": row["mean_gap"],
        "cascade_length": row["cascade_length"],
        "length_difference": row["length_difference"],
        # Equal extracted answers (neither answering counts as agreeing), as the statistics
        # count it, for results stored by earlier releases too; none in a scan (no replay text).
        "semantic_agree": (
            row["answer_a"] == row["answer_b"]
            if row["answer_extractor"] is not None and mode != "scan"
            else None
        ),
        "mode": mode,
        "created_at": created.isoformat() if isinstance(created, datetime) else created,
        "margin_logged": row["margin_a"],
        "margin_logged_ulps": row["margin_a_ulps"],
        "margin_logged_source": row["margin_a_source"],
        "margin_replay": row["margin_b"],
        "margin_replay_ulps": row["margin_b_ulps"],
        "screen": row["screen"],
        "token_ids_source": ids_source,
        "window_cut": bool(row["window_cut"]),
        "baseline": row["baseline"] or "logged",
    }
    for key in ("exact_match", "tie", "semantic_agree"):
        if out[key] is not None:
            out[key] = bool(out[key])
    if full:
        # The result as `GET /v1/replays/{id}/results` gives it.
        result = result_json(
            row["result"], row["public_id"], run.public_id, token_ids_source=ids_source
        )
        for key in ("margin_at_divergence", "single_step", "semantic", "arms"):
            out[key] = result[key]
    return out


def _ids_source(sources: dict[int, str | None], row: Mapping[str, Any]) -> str | None:
    """Where the row's trace's ids come from, read once per configuration."""
    config_id = int(row["config_id"])
    if config_id not in sources:
        sources[config_id] = token_ids_source(orjson.loads(row["config_json"]))
    return sources[config_id]


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest round-trip form: the CSV loses no precision
    if isinstance(value, list):
        value = ";".join(str(v) for v in value)
    text = str(value)
    if key in _USER_TEXT and text.startswith(_FORMULA_START):
        return "'" + text
    return text


def csv_line(values: Sequence[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerow(values)
    return buffer.getvalue()


def stream(factory: sessionmaker[Session], run: ReplayRun, fmt: ExportFormat) -> Iterator[bytes]:
    """The export of `run` in `fmt`, as chunks of bytes (one chunk per batch of results)."""
    full = fmt == "jsonl"
    if fmt == "csv":
        yield csv_line(EXPORT_FIELDS).encode()
    after = 0
    sources: dict[int, str | None] = {}  # by configuration: a run's traces share a few
    while True:
        with unit_of_work(factory, read_only=True) as uow:
            rows = repository.export_batch(
                uow.session, run.id, after_id=after, full=full, limit=BATCH
            )
        if not rows:
            return
        after = int(rows[-1]["id"])
        records = (record(run, r, full=full, ids_source=_ids_source(sources, r)) for r in rows)
        if fmt == "csv":
            yield "".join(
                csv_line([_cell(k, rec[k]) for k in EXPORT_FIELDS]) for rec in records
            ).encode()
        else:
            yield b"".join(orjson.dumps(rec) + b"\n" for rec in records)


def filename(run: ReplayRun, fmt: ExportFormat) -> str:
    return f"{run.public_id}.{fmt}"
