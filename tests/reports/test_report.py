"""The report layer against the rows it summarises and the stored aggregate: every number of
`GET /v1/replays/{id}/report` is recomputed here from the per-trace results (or, for the lift,
from the stats functions on the per-trace flags). SQLite and PostgreSQL."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.db.unit_of_work import session_scope
from replay_audit.diff import get_extractor
from replay_audit.replays.models import ReplayRun
from replay_audit.reports import browsing, statistics
from replay_audit.stats import (
    correctness_flips,
    distribution,
    mcnemar_exact,
    paired_bootstrap_lift,
    proportion,
    tost_noninferiority,
)
from tests.reports.conftest import (
    PROMPTS,
    HoldingRunner,
    SeededRun,
    all_results,
    ingest,
    make_traces,
    seed_run,
)

pytestmark = pytest.mark.usefixtures("worker_env")


def _traces(client: TestClient, ids: list[str], headers: dict[str, str]) -> dict[str, Any]:
    return {i: client.get(f"/v1/traces/{i}", headers=headers).json() for i in ids}


def test_report_matches_the_rows_and_the_stored_aggregate(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    run = client.get(f"/v1/replays/{seeded_run.run_id}", headers=h).json()
    r = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=h)
    assert r.status_code == 200, r.text
    report = r.json()
    rows = all_results(client, seeded_run.run_id, h)
    assert report["partial"] is False and report["n_results"] == len(rows) == 3 * len(
        seeded_run.trace_ids
    )  # FP16, FP16 + C and the reproduction check the run added (exact: BF16 as logged)
    stored = {c["index"]: c for c in run["statistics"]["comparisons"]}
    for c in report["comparisons"]:
        mine = [x for x in rows if x["comparison"] == c["index"]]
        ok = [x for x in mine if x["status"] == "ok"]
        diverged = [x for x in ok if not x["exact_match"]]
        exact = len(ok) - len(diverged)
        p = proportion(exact, len(ok))
        assert c["ear"] == {
            "successes": exact,
            "n": len(ok),
            "estimate": p.estimate,
            "low": p.interval.low,
            "high": p.interval.high,
        }
        assert c["ear"] == stored[c["index"]]["ear"]
        if c["index"] == 0:
            assert 0 < exact < len(ok)  # FP16 alone: both outcomes
        else:
            assert exact == len(ok)  # FP16 + C repairs every close call
        assert c["n"] == len(mine) and c["failed"] == 0
        steps = sum(len(x["arms"]["b"]["margins"]) for x in ok)  # one margin per replayed step
        triggers = sum(x["gate_triggers"] for x in ok)
        assert c["steps"] == steps == stored[c["index"]]["steps"]
        assert c["gate_triggers"] == triggers
        assert c["trigger_rate"] == pytest.approx(triggers / steps)
        assert c["mean_gap"] == pytest.approx(stored[c["index"]]["mean_gap"])
        # SAR from the per-trace semantic answers.
        semantic = [x["semantic"]["agree"] for x in ok]
        assert c["sar"]["successes"] == sum(semantic) and c["sar"]["n"] == len(semantic)
        assert c["sar"] == stored[c["index"]]["sar"]
        cats = Counter(x["category"] for x in ok)
        names = ("agreed", "head_reachable", "kv_dependent", "body_dominated")
        assert {k: v["successes"] for k, v in c["categories"].items()} == {
            k: cats.get(k, 0) for k in names
        }
        assert c["categories"] == stored[c["index"]]["categories"]
        # Distributions of the divergent results.
        t_stars = [x["first_divergence_step"] for x in diverged]
        if diverged:
            d = distribution([float(t) for t in t_stars])
            assert c["first_divergence_step"]["median"] == d.median
            assert c["first_divergence_step"] == stored[c["index"]]["first_divergence_step"]
            assert sum(c["t_star_histogram"]["counts"]) == len(diverged)
            replay_margins = [x["margin_at_divergence"]["b"]["abs"] for x in diverged]
            hist = c["margin_at_divergence"]["histogram_b"]
            assert hist["zeros"] + sum(hist["counts"]) + hist["below"] + hist["above"] == len(
                [m for m in replay_margins if m is not None]
            )
            assert c["margin_at_divergence"]["b"] == stored[c["index"]]["margin_at_divergence"]["b"]
        else:
            assert c["first_divergence_step"] is None and c["t_star_histogram"] is None


def test_lifts_match_the_per_trace_flags_and_the_aggregate(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    report = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=h).json()
    stored = client.get(f"/v1/replays/{seeded_run.run_id}", headers=h).json()["statistics"]
    rows = all_results(client, seeded_run.run_id, h)
    by = {(x["trace_id"], x["comparison"]): x for x in rows}
    traces = sorted({x["trace_id"] for x in rows})
    base = [bool(by[(t, 0)]["exact_match"]) for t in traces]
    treat = [bool(by[(t, 1)]["exact_match"]) for t in traces]
    expected = paired_bootstrap_lift(base, treat, resamples=10_000, seed=0)
    (lift,) = report["lifts"]
    assert (lift["lift"], lift["low"], lift["high"]) == (
        expected.lift,
        expected.low,
        expected.high,
    )
    assert lift["fixed"] == expected.fixed > 0  # C repairs the close calls
    assert lift["broke"] == expected.broke == 0
    assert lift["mcnemar_p"] == mcnemar_exact(expected.broke, expected.fixed).p_value
    fixed_ids = {t for t, b, a in zip(traces, base, treat, strict=True) if a and not b}
    assert {x["id"] for x in lift["fixed_traces"]} == fixed_ids
    (agg,) = stored["lifts"]
    assert (agg["lift"], agg["low"], agg["high"]) == (lift["lift"], lift["low"], lift["high"])
    assert {x["id"] for x in agg["fixed_traces"]} == fixed_ids

    # Any pair, either way round: (1 over 0) is the mirror of (0 over 1).
    rev = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"a": 1, "b": 0}, headers=h
    ).json()["pair"]
    assert rev["lift"] == -lift["lift"]
    assert (rev["fixed"], rev["broke"]) == (lift["broke"], lift["fixed"])
    assert {x["id"] for x in rev["broke_traces"]} == fixed_ids
    # One of a and b alone pairs it with comparison 0 (issue 33: it was a schema-valid 422).
    alone = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"a": 1}, headers=h
    ).json()["pair"]
    assert alone == rev
    alone = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"b": 1}, headers=h
    ).json()["pair"]
    assert alone["lift"] == lift["lift"] and alone["fixed"] == lift["fixed"]
    same = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"a": 0, "b": 0}, headers=h
    ).json()["pair"]
    assert same["lift"] == same["low"] == same["high"] == 0.0
    assert same["fixed"] == same["broke"] == 0 and same["mcnemar_p"] == 1.0


def test_list_limit_truncates_the_listed_traces_not_the_counts(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    full = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=h).json()["lifts"][0]
    assert full["fixed"] >= 2
    cut = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"list_limit": 1}, headers=h
    ).json()["lifts"][0]
    assert cut["fixed"] == full["fixed"] and cut["fixed_more"] is True
    assert [x["id"] for x in cut["fixed_traces"]] == [full["fixed_traces"][0]["id"]]


def test_task_accuracy_flips_and_tost_from_the_answers(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    report = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=h).json()
    acc = report["accuracy"]
    assert acc is not None and acc["extractors"] == ["gsm8k"]
    rows = all_results(client, seeded_run.run_id, h)
    traces = _traces(client, seeded_run.trace_ids, h)
    gsm8k = get_extractor("gsm8k")
    ref = {t: gsm8k(traces[t]["reference_answer"]) for t in traces}
    # FP16 (0), FP16 + C (1) and the reproduction check the run added (2: BF16 as logged).
    correct: dict[Any, dict[str, bool]] = {"logged": {}, 0: {}, 1: {}, 2: {}}
    for x in rows:
        sem = x["semantic"]
        correct["logged"][x["trace_id"]] = sem["answer_a"] == ref[x["trace_id"]]
        correct[x["comparison"]][x["trace_id"]] = sem["answer_b"] == ref[x["trace_id"]]
        # The worker's own flags agree with the answers recomputed here.
        assert sem["correct_b"] == correct[x["comparison"]][x["trace_id"]]
    assert [a["arm"] for a in acc["arms"]] == ["logged", 0, 1, 2]
    for arm in acc["arms"]:
        flags = correct[arm["arm"]]
        assert arm["accuracy"]["successes"] == sum(flags.values())
        assert arm["accuracy"]["n"] == len(flags) == len(seeded_run.trace_ids)
    # The logged arm is right exactly where the reference is (two in three by construction).
    assert acc["arms"][0]["accuracy"]["successes"] == sum(
        1 for i in range(len(seeded_run.trace_ids)) if i % 3
    )
    order = sorted(correct["logged"])
    for pair in acc["pairs"]:
        base = [correct["logged"][t] for t in order]
        treat = [correct[pair["treated"]][t] for t in order]
        flips = correctness_flips(base, treat)
        assert (pair["flips"]["gained"], pair["flips"]["lost"], pair["flips"]["n"]) == (
            flips.gained,
            flips.lost,
            flips.n,
        )
        tost = tost_noninferiority(base, treat, margin=0.05)
        assert pair["tost"]["p_value"] == pytest.approx(tost.p_value)
        assert pair["tost"]["non_inferior"] == tost.non_inferior
    # FP16 alone changes final answers of some traces; C restores every one of them.
    # The logged configuration replayed here (the check) reproduces every answer.
    fp16, with_c, check = acc["pairs"]
    assert fp16["flips"]["gained"] + fp16["flips"]["lost"] > 0
    assert with_c["flips"]["gained"] == with_c["flips"]["lost"] == 0
    assert check["flips"]["gained"] == check["flips"]["lost"] == 0

    wide = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", params={"margin": 0.9}, headers=h
    ).json()["accuracy"]
    assert wide["margin"] == 0.9
    assert wide["pairs"][0]["tost"]["p_value"] <= fp16["tost"]["p_value"]
    assert wide["pairs"][0]["tost"]["non_inferior"] is True


def test_worker_stores_the_margin_track_and_gate_firings(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    rows = all_results(client, seeded_run.run_id, headers("auditor"))
    for x in rows:
        d = x["arms"]["b"]
        assert len(d["margins"]) == len(d["output_token_ids"])
        assert len(d["gate_fired_steps"]) == x["gate_triggers"]
        assert all(d["margins"][t] < 1e-3 for t in d["gate_fired_steps"])
        assert d["text"] == "".join(f" {t}" for t in d["output_token_ids"])
    assert any(x["gate_triggers"] for x in rows)


def test_a_run_still_queued_has_a_partial_report(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    ids = ingest(client, h, make_traces(logged_trace, PROMPTS[:3]))
    run_id = client.post(
        "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
    ).json()["id"]
    report = client.get(f"/v1/replays/{run_id}/report", headers=h).json()
    assert report["partial"] is True and report["status"] == "queued"
    # FP16 and the reproduction check the run added, neither with a result yet.
    assert [c["label"] for c in report["comparisons"]] == [
        "logged vs T0: fp16",
        "logged vs T1: self: reproduction check",
    ]
    for c in report["comparisons"]:
        assert c["n"] == 0 and c["ear"]["n"] == 0 and c["ear"]["estimate"] is None
    assert report["lifts"] == [] and report["accuracy"] is None


def test_a_run_of_several_runs_is_paired_by_trace(
    client: TestClient,
    seeded_run: SeededRun,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """The two-run comparison: traces fixed and broke across runs (C in one, FP16 in the
    other gives broken traces), on the traces both replayed."""
    h = headers("admin")
    other = seed_run(client, runner, h, logged_trace, targets=[{"dtype": "fp16"}])
    assert other.trace_ids == seeded_run.trace_ids  # idempotent ingest: the same traces
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        project_id = s.scalar(
            select(ReplayRun.project_id).where(ReplayRun.public_id == seeded_run.run_id)
        )
        assert project_id is not None
        run_a = browsing.get_run(s, project_id, seeded_run.run_id)
        run_b = browsing.get_run(s, project_id, other.run_id)
        cmp = statistics.compare_runs(s, run_a, 1, run_b, 0)
        own = statistics.run_report(s, run_a)
    assert cmp.common_traces == len(seeded_run.trace_ids)
    # Run B's FP16 against run A's FP16 + C: what C fixed, B "broke".
    assert cmp.pair.broke == own.lifts[0].fixed and cmp.pair.fixed == 0
    assert cmp.pair.lift == -own.lifts[0].lift


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"a": 0, "b": 5}, "b"),
        ({"margin": 1.5}, "margin"),
        ({"alpha": 0.7}, "alpha"),
    ],
)
def test_bad_report_parameters_are_422(
    client: TestClient,
    seeded_run: SeededRun,
    headers: Callable[..., dict[str, str]],
    params: dict[str, Any],
    field: str,
) -> None:
    r = client.get(f"/v1/replays/{seeded_run.run_id}/report", params=params, headers=headers())
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field


def test_report_of_another_projects_run_is_404(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    r = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=headers("admin", "other"))
    assert r.status_code == 404
    assert client.get(f"/v1/replays/{seeded_run.run_id}/report").status_code == 401


def test_a_report_follows_its_run_from_queued_to_done_and_refinalised(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """An unfinished run's report is computed from its rows; a finished run's is the statistics
    stored when it finished (read back, not recomputed), and finalising again stores them anew."""
    from replay_audit.replays import service as replays_service

    h = headers("admin")
    ids = ingest(client, h, make_traces(logged_trace, PROMPTS[:6]))
    run_id = client.post(
        "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
    ).json()["id"]
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]

    def report() -> Any:
        with session_scope(url) as s:
            project_id = s.scalar(select(ReplayRun.project_id).where(ReplayRun.public_id == run_id))
            assert project_id is not None
            return statistics.run_report(s, browsing.get_run(s, project_id, run_id))

    queued = report()
    assert queued.partial and queued.comparisons[0].n == 0
    runner.run_all()
    done = report()
    assert not done.partial and done.comparisons[0].n == len(ids)
    assert report().lifts == done.lifts == []
    with session_scope(url) as s:
        run = s.scalar(select(ReplayRun).where(ReplayRun.public_id == run_id))
        assert run is not None and run.aggregate is not None
        assert run.aggregate["comparisons"][0]["ear"] == done.comparisons[0].ear.model_dump()
        # What is served is what is stored: a marker written into the stored object shows up.
        run.aggregate = {
            **run.aggregate,
            "comparisons": [{**run.aggregate["comparisons"][0], "label": "stored marker"}],
        }
    assert report().comparisons[0].label == "stored marker"
    with session_scope(url) as s:
        run = s.scalar(select(ReplayRun).where(ReplayRun.public_id == run_id))
        assert run is not None
        replays_service.finalise_run(s, run)
    again = report()
    assert again == done and again.comparisons[0].label != "stored marker"


def test_statistics_cleared_by_the_upgrade_are_stored_again(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    """Migration 0005 cleared the earlier aggregate shape; `store_missing` (run by `db upgrade`
    and `serve`) stores the statistics again, equal to what finalising stored."""
    from replay_audit.replays.statistics import store_missing

    h = headers("auditor")
    before = client.get(f"/v1/replays/{seeded_run.run_id}", headers=h).json()["statistics"]
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        run = s.scalar(select(ReplayRun).where(ReplayRun.public_id == seeded_run.run_id))
        assert run is not None
        run.aggregate = None  # what the migration leaves
    with session_scope(url) as s:
        assert store_missing(s) == 1
    with session_scope(url) as s:
        assert store_missing(s) == 0  # once
        run = s.scalar(select(ReplayRun).where(ReplayRun.public_id == seeded_run.run_id))
        assert run is not None and run.aggregate == before


def test_a_submitter_reads_a_runs_status_and_nothing_it_produced(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    """A leaked ingest key may start a replay and poll it, but never download what it produced:
    no report, no export, no results, and no statistics (their lifts list fixed and broke trace
    ids) nor the run's trace list in the status it polls."""
    run_id = seeded_run.run_id
    submitter = headers("submitter")
    auditor = client.get(f"/v1/replays/{run_id}", headers=headers("auditor")).json()
    listed = [t["id"] for lift in auditor["statistics"]["lifts"] for t in lift["fixed_traces"]]
    assert listed, "the seeded run should list fixed traces (else this test proves nothing)"

    for path in (f"/v1/replays/{run_id}/report", f"/v1/replays/{run_id}/results"):
        r = client.get(path, headers=submitter)
        assert r.status_code == 403 and r.json()["error"] == "PermissionDenied", path
    for fmt in ("csv", "jsonl"):
        r = client.get(f"/v1/replays/{run_id}/export", params={"format": fmt}, headers=submitter)
        assert r.status_code == 403 and r.json()["error"] == "PermissionDenied", fmt

    r = client.get(f"/v1/replays/{run_id}", headers=submitter)
    assert r.status_code == 200, r.text
    status = r.json()
    assert status["status"] == "done" and status["progress"] == auditor["progress"]
    assert status["n_traces"] == len(seeded_run.trace_ids)
    assert status["statistics"] is None and "aggregate" not in status
    assert "trace_ids" not in status["request"]
    # No trace id, external id, token or text anywhere in what a submitter reads.
    for trace_id in seeded_run.trace_ids:
        assert trace_id not in r.text
    assert "ext-" not in r.text
