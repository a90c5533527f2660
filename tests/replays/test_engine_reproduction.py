"""Traces logged by another engine (issue 11): a run over them first replays each in its own
logged configuration on this engine; each result says whether the engine reproduced the logged
tokens, the statistics give the engine reproduction rate and each comparison's divergences not
attributable to the format, and the UI says so. Runs on SQLite and PostgreSQL with the fake
engine, whose tokens are known by construction: a "vLLM" trace whose logged output is the fake
BF16 arm's own is reproduced; one whose output was changed at step 2 is not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.replays.conftest import HoldingRunner, all_results, ingest, run_to_done
from tests.ui.conftest import sign_in

pytestmark = pytest.mark.usefixtures("worker_env")

PROMPTS = [[i, (i * 7) % 13, 5] for i in range(1, 10)]
FP16 = {"dtype": "fp16"}
VLLM = {"name": "vllm", "version": "0.11.0"}


def _foreign(trace: dict[str, Any], *, change_at: int | None = None) -> dict[str, Any]:
    """`trace` as if vLLM had logged it; with `change_at`, its output differs from what this
    engine produces from that step on (so the engine cannot reproduce it)."""
    out = dict(trace)
    out["config"] = {**trace["config"], "engine": VLLM}
    if change_at is not None:
        ids = list(trace["output_token_ids"])
        ids[change_at] = (ids[change_at] + 1) % 50
        out["output_token_ids"] = ids
        out["top_k"] = None  # the margins are the logged arm's: no longer these tokens'
    return out


def test_a_run_over_other_engines_traces_checks_the_engine_first(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    own = [logged_trace(p) for p in PROMPTS[:3]]
    reproduced = [_foreign(logged_trace(p)) for p in PROMPTS[3:6]]
    changed = [_foreign(logged_trace(p), change_at=2) for p in PROMPTS[6:]]
    ids = ingest(client, h, own + reproduced + changed)
    own_ids, reproduced_ids, changed_ids = ids[:3], ids[3:6], ids[6:]

    run = run_to_done(client, h, runner, {"trace_ids": ids, "targets": [FP16]})
    # The run added the check: a self target, compared with the logged tokens.
    assert len(run["targets"]) == 2 and run["targets"][1]["self"] is True
    assert run["comparisons"][1] == {"index": 1, "a": "logged", "b": 1}

    results = all_results(client, run["id"], h, limit=7)
    assert len(results) == 2 * len(ids)
    check = {x["trace_id"]: x for x in results if x["comparison"] == 1}
    # This engine reproduces its own traces and the unchanged vLLM ones exactly; the changed
    # ones diverge where they were changed (or earlier: never later).
    assert all(check[i]["exact_match"] for i in own_ids + reproduced_ids)
    assert all(check[i]["first_divergence_step"] <= 2 for i in changed_ids)
    for x in results:
        want = x["trace_id"] in reproduced_ids
        want_or_none = None if x["trace_id"] in own_ids else want
        assert x["engine_reproduced"] is want_or_none, x

    stats = run["statistics"]
    er = stats["engine_reproduction"]
    assert er["comparison"] == 1 and er["n"] == 6 and er["engines"] == {"vllm": 6}
    assert er["reproduced"]["successes"] == 3 and er["reproduced"]["n"] == 6
    assert sorted(t["id"] for t in er["not_reproduced"]) == sorted(changed_ids)
    baseline = stats["comparisons"][0]
    diverged_changed = sum(
        1
        for x in results
        if x["comparison"] == 0 and x["trace_id"] in changed_ids and not x["exact_match"]
    )
    assert diverged_changed == 3  # the FP16 arm never produces the changed tokens
    assert baseline["not_attributable"] == diverged_changed
    assert stats["comparisons"][1]["not_attributable"] is None  # the check itself
    # /report is the same object.
    report = client.get(f"/v1/replays/{run['id']}/report", headers=h).json()
    assert report["engine_reproduction"] == er

    # The UI: the run page reports the check; a changed trace's page says its divergence is
    # not attributable to the format, a reproduced one's says it is.
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}").text
    assert 'id="engine-reproduction"' in page and "vllm: 6" in page
    assert all(i in page for i in changed_ids)
    bad = client.get(f"/ui/runs/{run['id']}/traces/{changed_ids[0]}?comparison=0").text
    assert 'id="not-attributable"' in bad and "(vllm)" in bad
    good = client.get(f"/ui/runs/{run['id']}/traces/{reproduced_ids[0]}?comparison=0").text
    assert 'id="not-attributable"' not in good and 'id="engine-reproduced"' in good
    mine = client.get(f"/ui/runs/{run['id']}/traces/{own_ids[0]}?comparison=0").text
    assert 'id="not-attributable"' not in mine and 'id="engine-reproduced"' not in mine


def test_no_check_for_own_traces_and_none_when_turned_off(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    own = ingest(client, h, [logged_trace(p) for p in PROMPTS[:2]])
    run = run_to_done(client, h, runner, {"trace_ids": own, "targets": [FP16]})
    assert len(run["targets"]) == 1 and run["statistics"]["engine_reproduction"] is None
    assert run["statistics"]["comparisons"][0]["not_attributable"] is None

    foreign = ingest(client, h, [_foreign(logged_trace(p)) for p in PROMPTS[2:4]])
    off = run_to_done(
        client, h, runner, {"trace_ids": foreign, "targets": [FP16], "engine_check": "off"}
    )
    assert len(off["targets"]) == 1 and off["statistics"]["engine_reproduction"] is None

    # A run that asked for the self-replay itself gets no second one: that is the check.
    pairwise = run_to_done(
        client,
        h,
        runner,
        {"trace_ids": foreign, "targets": [FP16], "compare_with": "self", "compare": "pairwise"},
    )
    assert sum(1 for t in pairwise["targets"] if t.get("self")) == 1
    # Pairwise compared T0 with self; the check (logged vs self) was added as comparison 1.
    assert pairwise["comparisons"] == [
        {"index": 0, "a": 0, "b": 1},
        {"index": 1, "a": "logged", "b": 1},
    ]
    er = pairwise["statistics"]["engine_reproduction"]
    assert er["comparison"] == 1 and er["reproduced"]["successes"] == 2

    r = client.post(
        "/v1/replays",
        json={"trace_ids": foreign, "targets": [FP16], "engine_check": "on"},
        headers=h,
    )
    assert r.status_code == 422 and "engine_check" in r.text
