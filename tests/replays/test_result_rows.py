"""A replay job's rows: `results.result_values` storing the domain's own forms, and
`repository.insert_results_of`, the write of a window: every row stored with what it holds (a
value a row lacks, and a None, as NULL), a (run, trace, comparison) already stored left alone
in a window that also holds new rows, a deleted trace's rows dropped."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from replay_audit.auth.service import create_api_key
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine import Target
from replay_audit.replays import repository
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.pipeline import replay_trace
from replay_audit.replays.results import ResultRow, failed_values, result_values
from replay_audit.traces import service as traces_service
from replay_audit.traces.models import Trace
from replay_audit.traces.schemas import TraceCreate
from tests.factories import make_trace


def _run_and_traces(db_url: str, n: int) -> tuple[int, list[int]]:
    with session_scope(db_url) as s:
        project_id = create_api_key(s, "rows", "admin").api_key.project_id
        stored = traces_service.ingest_traces(
            s, project_id, [TraceCreate.model_validate(make_trace()) for _ in range(n)]
        )
        run = ReplayRun(
            public_id="rr_rows",
            project_id=project_id,
            mode="scan",
            compare="logged",
            request={},
            targets=[],
            comparisons=[],
            n_traces=n,
            n_items=2 * n,
        )
        s.add(run)
        s.flush()
        by_public = dict(s.execute(select(Trace.public_id, Trace.id)).all())
        return run.id, [by_public[r.id] for r in stored]


def _ok_row(comparison: int) -> ResultRow:
    """An ok row as a scan's: some columns None, some left out, an array and a detail."""
    return {
        "comparison": comparison,
        "status": "ok",
        "error": None,
        "exact_match": False,
        "first_divergence_step": 3,
        "category": None,
        "margin_a": 0.5,
        "margin_b": None,
        "tie": True,
        "output_b": np.array([5, 6, 7, 8], np.int32),
        "output_a": None,
        "detail": {"mode": "scan", "arms": {"b": {"margins": [1.5, None, 0.25]}}},
        "screen": None,
        "window_cut": False,
        "baseline": "logged",
    }


def _rows(db_url: str, run_id: int) -> dict[tuple[int, int], ReplayResult]:
    with session_scope(db_url) as s:
        found = s.scalars(select(ReplayResult).where(ReplayResult.run_id == run_id)).all()
        return {(r.trace_id, r.comparison): r for r in found}


def test_a_window_stores_each_row_as_it_is_and_a_retry_adds_only_what_is_missing(
    db_url: str,
) -> None:
    run_id, (t1, t2) = _run_and_traces(db_url, 2)
    gone = max(t1, t2) + 1000  # a trace retention deleted
    with session_scope(db_url) as s:
        repository.insert_results_of(
            s,
            run_id,
            [
                (t1, [_ok_row(0), failed_values(1, "first")]),
                (gone, [failed_values(0, "never stored")]),
                (t2, [failed_values(0, "first")]),
            ],
        )
    rows = _rows(db_url, run_id)
    assert set(rows) == {(t1, 0), (t1, 1), (t2, 0)}
    ok = rows[(t1, 0)]
    assert (ok.status, ok.exact_match, ok.first_divergence_step, ok.tie) == ("ok", False, 3, True)
    assert ok.margin_a == 0.5 and ok.output_b is not None
    assert ok.output_b.tolist() == [5, 6, 7, 8]
    assert ok.detail == {"mode": "scan", "arms": {"b": {"margins": [1.5, None, 0.25]}}}
    # Given as None, or not given at all: NULL.
    left_out: dict[str, Any] = {
        "category": ok.category,
        "margin_b": ok.margin_b,
        "output_a": ok.output_a,
        "screen": ok.screen,
        "gate_triggers": ok.gate_triggers,
        "semantic_agree": ok.semantic_agree,
        "resolved_a": ok.resolved_a,
    }
    assert all(v is None for v in left_out.values()), left_out
    failed = rows[(t1, 1)]
    assert (failed.status, failed.error, failed.detail) == ("failed", "first", {})
    assert failed.exact_match is None and failed.output_b is None and failed.baseline is None

    # A retried window: what is stored stays as it was, what is missing is added, once.
    with session_scope(db_url) as s:
        repository.insert_results_of(
            s,
            run_id,
            [
                (t1, [failed_values(0, "second"), failed_values(1, "second")]),
                (t2, [failed_values(0, "second"), _ok_row(1)]),
            ],
        )
    rows = _rows(db_url, run_id)
    assert set(rows) == {(t1, 0), (t1, 1), (t2, 0), (t2, 1)}
    assert rows[(t1, 0)].status == "ok" and rows[(t1, 1)].error == "first"
    assert rows[(t2, 0)].error == "first"
    assert rows[(t2, 1)].status == "ok" and rows[(t2, 1)].output_b is not None


@pytest.mark.parametrize("mode", ["scan", "decode"])
def test_a_rows_target_resolved_arm_and_probe_are_their_stored_forms(
    tmp_path: Path, mode: str
) -> None:
    """`result_values` reads the dataclasses straight (`results._plain`), not through their
    `to_dict`/`to_json`/`asdict`: what it stores must stay what those give."""
    from tests.replays.test_pipeline import fake_pool, flipped
    from tests.replays.test_pipeline import make_trace as logged_trace

    (tmp_path / "model.safetensors").write_bytes(b"not really weights")
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4)}})
    outcome = replay_trace(
        logged_trace(tmp_path),
        Target("fp16"),
        pool,
        model_dir=tmp_path,
        mode=mode,  # type: ignore[arg-type]
    )
    assert outcome.b.resolved is not None and outcome.single_step is not None
    assert outcome.a.target is not None and outcome.b.target is not None

    def stored(x: Any) -> Any:
        return json.loads(json.dumps(x))

    row = result_values(0, outcome)
    arms = row["detail"]["arms"]
    assert arms["a"]["target"] == stored(outcome.a.target.to_dict())  # type: ignore[index]
    assert arms["b"]["target"] == stored(outcome.b.target.to_dict())  # type: ignore[index]
    assert row["resolved_b"] is not None
    assert json.loads(row["resolved_b"]) == stored(outcome.b.resolved.to_json())
    assert row["detail"]["single_step"] == stored(asdict(outcome.single_step))
