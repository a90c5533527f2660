"""Reproduce before compare (issue 31): every run first replays each trace in its own logged
configuration (the reproduction check, a self arm against the logged tokens) and reports how
many reproduced. A trace that does not reproduce is judged against that replay in its
comparisons with the logged tokens (`baseline: "reproduced"`): no precision flip is counted
against logged tokens the stack does not give. A trace of an engine this service cannot run
(vLLM) is always compared with its replayed logged configuration (`baseline: "replayed"`).
The API, the report, the export and the UI say so. Runs on SQLite and PostgreSQL with the fake
engine, whose tokens are known by construction: a trace whose logged output is the fake BF16
arm's own reproduces; one whose output was changed at step 2 does not."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.engine import FakeEngine
from tests.replays.conftest import HoldingRunner, _close, all_results, ingest, run_to_done
from tests.ui.conftest import sign_in

pytestmark = pytest.mark.usefixtures("worker_env")

PROMPTS = [[i, (i * 7) % 13, 5] for i in range(1, 10)]
FP16 = {"dtype": "fp16"}
VLLM = {"name": "vllm", "version": "0.11.0"}


def _changed(trace: dict[str, Any], at: int = 2) -> dict[str, Any]:
    """`trace` with its output changed from step `at` on (as a nondeterministic kernel of the
    logging stack, or another stack, would leave it): this engine cannot reproduce it."""
    out = dict(trace)
    ids = list(trace["output_token_ids"])
    ids[at] = (ids[at] + 1) % 50
    out["output_token_ids"] = ids
    out["top_k"] = None  # the margins are the logged arm's: no longer these tokens'
    return out


def _foreign(trace: dict[str, Any]) -> dict[str, Any]:
    return {**trace, "config": {**trace["config"], "engine": VLLM}}


def _by(results: list[dict[str, Any]], comparison: int) -> dict[str, dict[str, Any]]:
    return {x["trace_id"]: x for x in results if x["comparison"] == comparison}


def test_a_trace_that_does_not_reproduce_is_judged_against_its_reproduced_baseline(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    twins = PROMPTS[:4]
    reproduced_ids = ingest(client, h, [logged_trace(p) for p in twins])
    changed_ids = ingest(client, h, [_changed(logged_trace(p)) for p in twins])
    ids = reproduced_ids + changed_ids

    run = run_to_done(client, h, runner, {"trace_ids": ids, "targets": [FP16]})
    # The run added the check: a self target, compared with the logged tokens.
    assert len(run["targets"]) == 2 and run["targets"][1]["self"] is True
    assert run["comparisons"][1] == {"index": 1, "a": "logged", "b": 1}

    results = all_results(client, run["id"], h, limit=7)
    assert len(results) == 2 * len(ids)
    check, fp16 = _by(results, 1), _by(results, 0)
    assert all(check[i]["exact_match"] for i in reproduced_ids)
    assert all(check[i]["first_divergence_step"] <= 2 for i in changed_ids)
    for x in results:
        assert x["engine_reproduced"] is (x["trace_id"] in reproduced_ids), x
    # A reproduced trace is judged against its logged tokens; a changed one against the
    # logged configuration replayed here (arm A ran here), which is what its reproduced twin's
    # logged tokens are: the same t*, the same category, no flip counted against the change.
    for good, bad in zip(reproduced_ids, changed_ids, strict=True):
        assert fp16[good]["baseline"] == "logged" and fp16[good]["arms"]["a"]["resolved"] is None
        assert fp16[bad]["baseline"] == "reproduced"
        resolved_a = fp16[bad]["arms"]["a"]["resolved"]
        assert resolved_a is not None and resolved_a["dtype"] == "bf16"
        for key in ("exact_match", "first_divergence_step", "category"):
            assert fp16[bad][key] == fp16[good][key], (key, fp16[bad], fp16[good])
        assert check[bad]["baseline"] == "logged"  # the check itself is against the logged tokens
    diverged = sum(1 for i in reproduced_ids if not fp16[i]["exact_match"])
    assert diverged > 0  # the FP16 arm flips near-ties

    stats = run["statistics"]
    er = stats["engine_reproduction"]
    assert er["comparison"] == 1 and er["n"] == len(ids)
    assert er["reproduced"]["successes"] == len(twins) and er["reproduced"]["n"] == len(ids)
    assert sorted(t["id"] for t in er["not_reproduced"]) == sorted(changed_ids)
    assert stats["comparisons"][0]["baselines"] == {"logged": 4, "reproduced": 4}
    assert stats["comparisons"][0]["ear"]["successes"] == 2 * (len(twins) - diverged)
    assert stats["comparisons"][1]["baselines"] == {"logged": 8}
    # /report is the same object; the export says each result's baseline.
    report = client.get(f"/v1/replays/{run['id']}/report", headers=h).json()
    assert report["engine_reproduction"] == er
    export = client.get(f"/v1/replays/{run['id']}/export?format=jsonl", headers=h).text
    rows = [json.loads(line) for line in export.splitlines()]
    assert {(r["trace_id"], r["comparison"]): r["baseline"] for r in rows} == {
        (x["trace_id"], x["comparison"]): x["baseline"] for x in results
    }
    csv = client.get(f"/v1/replays/{run['id']}/export?format=csv", headers=h).text
    assert "baseline" in csv.splitlines()[0] and "reproduced" in csv

    # The UI: the run page reports the check and the results against a replayed baseline; a
    # changed trace's page says what it was judged against, a reproduced one's that it is the
    # format's.
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}").text
    assert 'id="engine-reproduction"' in page and "Against a replayed baseline" in page
    assert all(i in page for i in changed_ids)
    bad = client.get(f"/ui/runs/{run['id']}/traces/{changed_ids[0]}?comparison=0").text
    assert 'id="not-reproduced"' in bad and "reproduced baseline" in bad
    good = client.get(f"/ui/runs/{run['id']}/traces/{reproduced_ids[0]}?comparison=0").text
    assert 'id="not-reproduced"' not in good and 'id="engine-reproduced"' in good


def test_traces_of_an_engine_this_service_cannot_run_are_compared_with_their_replay(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    kept = ingest(client, h, [_foreign(logged_trace(p)) for p in PROMPTS[:3]])
    changed = ingest(client, h, [_foreign(_changed(logged_trace(p))) for p in PROMPTS[3:6]])
    run = run_to_done(client, h, runner, {"trace_ids": kept + changed, "targets": [FP16]})
    results = all_results(client, run["id"], h)
    fp16, check = _by(results, 0), _by(results, 1)
    assert all(x["baseline"] == "replayed" for x in fp16.values())
    assert all(x["arms"]["a"]["resolved"] is not None for x in fp16.values())
    assert all(check[i]["exact_match"] for i in kept)
    assert not any(check[i]["exact_match"] for i in changed)
    er = run["statistics"]["engine_reproduction"]
    assert er["engines"] == {"vllm": 6} and er["reproduced"]["successes"] == 3
    assert run["statistics"]["comparisons"][0]["baselines"] == {"replayed": 6}
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}/traces/{changed[0]}?comparison=0").text
    assert 'id="replayed-baseline"' in page and "vllm" in page


def test_no_check_when_turned_off_and_no_second_one_where_the_run_asked_for_self(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    changed = ingest(client, h, [_changed(logged_trace(p)) for p in PROMPTS[:2]])
    off = run_to_done(
        client, h, runner, {"trace_ids": changed, "targets": [FP16], "engine_check": "off"}
    )
    assert len(off["targets"]) == 1 and off["statistics"]["engine_reproduction"] is None
    # Without the check, every comparison is with the logged tokens as they are.
    assert all(x["baseline"] == "logged" for x in all_results(client, off["id"], h))
    assert off["statistics"]["comparisons"][0]["baselines"] == {"logged": 2}

    # A run that asked for the self-replay itself gets no second one: that is the check.
    pairwise = run_to_done(
        client,
        h,
        runner,
        {"trace_ids": changed, "targets": [FP16], "compare_with": "self", "compare": "pairwise"},
    )
    assert sum(1 for t in pairwise["targets"] if t.get("self")) == 1
    # Pairwise compared T0 with self; the check (logged vs self) was added as comparison 1.
    assert pairwise["comparisons"] == [
        {"index": 0, "a": 0, "b": 1},
        {"index": 1, "a": "logged", "b": 1},
    ]
    er = pairwise["statistics"]["engine_reproduction"]
    assert er["comparison"] == 1 and er["reproduced"]["successes"] == 0

    r = client.post(
        "/v1/replays",
        json={"trace_ids": changed, "targets": [FP16], "engine_check": "on"},
        headers=h,
    )
    assert r.status_code == 422 and "engine_check" in r.text


def _first_close(prompt: list[int], path: list[int]) -> int | None:
    """The first output step whose context (prompt ‖ path[:t]) is a close call of the fake."""
    return next((t for t in range(len(path)) if _close((*prompt, *path[:t]))), None)


def test_a_scan_run_judges_a_trace_that_does_not_reproduce_from_scans_and_decodes_nothing(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    api_key: Callable[..., str],
) -> None:
    """Issue 32: a scan run compares a trace its check did not reproduce with that replay along
    the logged tokens (both arms' scans, the check's reused), never by two decodes; t* is the
    first step whose scanned choices differ, and the teacher-forced probes at t* are the scans'
    own rows (no step, no decode)."""
    h = headers("admin")
    traces = [_changed(logged_trace(p, n=24)) for p in PROMPTS[:6]]
    ids = ingest(client, h, traces)
    calls: list[str] = []
    for name in ("decode", "step", "step_batch", "scan", "scan_batch"):
        real = getattr(FakeEngine, name)

        def spy(self: FakeEngine, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(FakeEngine, name, spy)
    run = run_to_done(client, h, runner, {"trace_ids": ids, "targets": [FP16], "mode": "scan"})
    assert set(calls) == {"scan_batch"}, calls  # one per arm's format: no decode, no step
    results = all_results(client, run["id"], h)
    fp16, check = _by(results, 0), _by(results, 1)
    flipped = 0
    for trace, i in zip(traces, ids, strict=True):
        assert check[i]["exact_match"] is False and check[i]["first_divergence_step"] == 2
        x = fp16[i]
        assert x["baseline"] == "reproduced" and x["mode"] == "scan"
        # Both arms along the changed logged tokens: they choose differently first at the
        # first close call on that path (FP16 picks the runner-up), not at the change.
        t = _first_close(trace["prompt_token_ids"], trace["output_token_ids"])
        assert x["first_divergence_step"] == t and x["exact_match"] is (t is None)
        if t is None:
            continue
        flipped += 1
        assert x["category"] == "head_reachable"
        step = x["single_step"]
        assert step["kind"] == "teacher_forced" and step["disagree"] is True
        assert x["arms"]["a"]["resolved"]["single_step"] == "teacher_forced"
        assert x["margin_at_divergence"]["a"]["source"] == "scan"
    assert flipped >= 3
    assert run["statistics"]["comparisons"][0]["baselines"] == {"reproduced": len(ids)}
    # The trace page says which probe ran.
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    some = next(i for i in ids if fp16[i]["first_divergence_step"] is not None)
    page = client.get(f"/ui/runs/{run['id']}/traces/{some}?comparison=0").text
    assert "row t* of a teacher-forced forward" in page and "from scratch over" not in page


@pytest.mark.parametrize("kind", ["database", "redis"])
def test_a_database_or_redis_blip_spends_no_attempt_of_a_replay_job(
    kind: str,
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 33: the database or Redis away for a moment (twice, here, as a window's results
    are written): the replay job waits it out in the same attempt, says why, and finishes with
    every result once."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from sqlalchemy.exc import OperationalError

    from replay_audit.db import job_row
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays import repository, tasks
    from replay_audit.replays.models import ReplayJob

    monkeypatch.setattr(job_row, "OUTAGE_BACKOFF_S", (0.01,))
    away = (
        OperationalError("INSERT", {}, Exception("server closed the connection"))
        if kind == "database"
        else RedisConnectionError("Error 111 connecting to redis:6379. Connection refused.")
    )
    blips = [away, away]
    real = repository.insert_results_of

    def insert(*a: Any, **k: Any) -> None:
        if blips:
            raise blips.pop()
        real(*a, **k)

    monkeypatch.setattr(tasks.repository, "insert_results_of", insert)
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    run = run_to_done(client, h, runner, {"trace_ids": ids, "targets": [FP16]})
    assert run["progress"]["done"] == 2 * len(ids) and not blips
    assert len(all_results(client, run["id"], h)) == 2 * len(ids)
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        assert [j.attempts for j in s.query(ReplayJob).all()] == [1]
    said = [m for m in caplog.messages if "no attempt spent" in m]
    assert len(said) == 2 and ("database" if kind == "database" else "Redis") in said[0], said


def test_a_run_never_reads_running_with_all_its_results_stored(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: a job's last results and its end (the run's status and statistics) commit
    together; before, another reader could see every result stored and the run `running`."""
    from sqlalchemy import create_engine, text

    from replay_audit.replays import service, tasks

    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    seen: list[tuple[str, int, int]] = []
    real = service.finish_job

    reader = create_engine(url)  # a plain reader (the service's sessions write-lock SQLite)

    def finish(session: Any, job_id: int) -> None:
        with reader.connect() as other:  # what any other reader sees at that moment
            status, total = other.execute(text("SELECT status, n_items FROM replay_runs")).one()
            done = other.execute(text("SELECT count(*) FROM replay_results")).scalar_one()
            seen.append((status, done, total))
        real(session, job_id)

    monkeypatch.setattr(tasks.service, "finish_job", finish)
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    run = run_to_done(client, h, runner, {"trace_ids": ids, "targets": [FP16]})
    assert run["progress"]["done"] == 2 * len(ids) and seen
    assert all(done < total for status, done, total in seen if status == "running"), seen
    reader.dispose()


def test_a_job_that_fails_every_attempt_gives_up_naming_the_last_error(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: each failure names its cause. A replay job whose every attempt raises is
    failed after its attempts saying what the last one raised, not 'worker killed or
    crashing' (which stays for a worker that died without a word)."""
    from replay_audit.replays import tasks

    def oom(*_: Any) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(tasks, "_run_job", oom)
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:2]])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    [spec] = runner.specs
    for _ in range(tasks.MAX_JOB_ATTEMPTS):
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            tasks.run_replay_job(*spec.args)
    tasks.run_replay_job(*spec.args)  # past its attempts: failed for good
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "failed", run
    said = run["error"]
    assert f"gave up after {tasks.MAX_JOB_ATTEMPTS} attempts" in said, said
    assert "RuntimeError: CUDA out of memory" in said and "worker killed" not in said, said


@pytest.mark.parametrize("value", ["sideways", "teacher\u0000forced", 7, None, "x" * 100_000])
def test_a_bad_single_step_is_a_422_naming_it(
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    runner: HoldingRunner,
    value: Any,
) -> None:
    h = headers("admin")
    ids = ingest(client, h, [logged_trace([1, 2, 3])])
    body = {"trace_ids": ids, "targets": [FP16], "single_step": value}
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 422 and r.json()["field"] == "single_step", r.text
    assert runner.specs == []


@pytest.mark.parametrize("sampled", [False, True])
def test_a_scan_then_decode_run_decodes_a_pair_only_in_its_samples(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    sampled: bool,
) -> None:
    """Issue 32: in scan-then-decode, a trace its check did not reproduce is compared with that
    replay as a trace is with its logged tokens: both arms' scans first, and two decodes from
    the prompt only for a pair in the run's flagged sample (the scans differ) or control
    sample (they agree). Outside them, a pair whose scans differ keeps the scans' result
    (`flagged_scanned`: t* the first step whose choices differ), one whose scans agree is only
    scanned (`scanned`: unknown). Before, every such pair was decoded twice in full."""
    h = headers("admin")
    traces = [_changed(logged_trace(p, n=24)) for p in PROMPTS[:6]]
    ids = ingest(client, h, traces)
    kept = ingest(client, h, [logged_trace(p, n=24) for p in PROMPTS[6:9]])  # they reproduce
    decodes: list[int] = []
    real = FakeEngine.decode

    def spy(self: FakeEngine, *a: Any, **k: Any) -> Any:
        decodes.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(FakeEngine, "decode", spy)
    share = 1.0 if sampled else 1e-9  # every trace in both samples, or (all but surely) none
    body = {
        "trace_ids": ids + kept,
        "targets": [FP16],
        "mode": "scan_then_decode",
        "flagged_fraction": share,
        "control_fraction": share,
        "scan_flag_ulps": -1,
    }
    run = run_to_done(client, h, runner, body)
    assert bool(decodes) is sampled
    results = all_results(client, run["id"], h)
    fp16, check = _by(results, 0), _by(results, 1)
    screens = set()
    for trace, i in zip(traces, ids, strict=True):
        assert check[i]["exact_match"] is False and check[i]["first_divergence_step"] == 2
        x = fp16[i]
        assert x["baseline"] == "reproduced" and x["mode"] == "scan_then_decode"
        t = _first_close(trace["prompt_token_ids"], trace["output_token_ids"])
        if sampled:  # both arms decoded from the prompt, why in the screen
            assert x["screen"] == ("flagged" if t is not None else "control")
            assert x["exact_match"] is (x["first_divergence_step"] is None)
            assert len(x["arms"]["a"]["output_token_ids"]) == len(trace["output_token_ids"])
        elif t is not None:  # the scans' result
            assert x["screen"] == "flagged_scanned"
            assert x["exact_match"] is False and x["first_divergence_step"] == t
            assert x["single_step"]["kind"] == "teacher_forced"
        else:  # only scanned: unknown, not agreed
            assert x["screen"] == "scanned"
            assert x["exact_match"] is None and x["category"] is None
        screens.add(x["screen"])
    assert len(screens) == 2  # both kinds of pair are in these six traces
    report = run["statistics"]["comparisons"][0]["screening"]
    assert report["decoded"] == len(ids + kept) if sampled else report["decoded"] == 0
    # The check: the six changed traces did not reproduce; the three others did, by their
    # scans alone where not decoded (unknown token for token, but not found diverging: they
    # are compared with their logged tokens, not listed as not reproduced).
    er = run["statistics"]["engine_reproduction"]
    assert sorted(t["id"] for t in er["not_reproduced"]) == sorted(ids)
    assert er["reproduced"]["successes"] == len(kept) and er["reproduced"]["n"] == len(ids + kept)
    assert er["scanned_only"] == (0 if sampled else len(kept))
    assert all(fp16[i]["baseline"] == "logged" for i in kept)
    assert all(check[i]["screen"] == ("control" if sampled else "scanned") for i in kept)
