"""What a number means, said where it could mislead: C against the logged tokens, the re-run
of the logged format, the intervals in the footer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.replays.conftest import HoldingRunner
from tests.reports.conftest import FP16, FP16_C, SeededRun, seed_run

pytestmark = pytest.mark.usefixtures("worker_env")

NOTE = 'id="c-against-logged-note"'


def _trace_page(ui: TestClient, run: SeededRun, comparison: int) -> str:
    return ui.get(
        f"/ui/runs/{run.run_id}/traces/{run.trace_ids[1]}", params={"comparison": comparison}
    ).text


def test_c_against_the_logged_tokens_is_said_to_measure_nothing(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    """Comparison 1 applies C to the replay arm against the logged tokens: the run page and
    that comparison's trace page say so; comparison 0 (no C) has no note."""
    ui = ui_client()
    run_page = ui.get(f"/ui/runs/{seeded_run.run_id}").text
    assert NOTE in run_page and "toward FP32, not toward the logged arm" in run_page
    assert "about zero by construction" in run_page
    assert NOTE in _trace_page(ui, seeded_run, 1)
    assert NOTE not in _trace_page(ui, seeded_run, 0)
    # The footer names both intervals: 95% for rates and lifts, 90% for TOST.
    assert "95% intervals" in run_page and "90% at \u03b1 = 0.05" in run_page
    assert "every rate with its 95% interval" not in run_page


def test_c_on_both_arms_gets_no_note(
    ui_client: Callable[..., TestClient],
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    run = seed_run(
        client, runner, headers("admin"), logged_trace,
        targets=[FP16, FP16_C], compare="pairwise",
    )
    ui = ui_client()
    assert NOTE not in ui.get(f"/ui/runs/{run.run_id}").text
    assert NOTE not in _trace_page(ui, run, 0)


def _rerun_notes(html: str) -> tuple[bool, bool]:
    margin = "re-run here for its margin at t*" in html
    single_only = "re-run here for the single-step re-run only" in html
    return margin, single_only


def test_the_re_run_note_is_not_claimed_for_a_logged_margin(
    ui_client: Callable[..., TestClient],
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    seeded_run: SeededRun,
) -> None:
    """Arm A's margin came from the logged top-k: the logged format was re-run for the
    single-step re-run only, and the page does not say it was re-run for its margin."""
    divergent = _divergent_trace(client, headers, seeded_run.run_id)
    html = ui_client().get(f"/ui/runs/{seeded_run.run_id}/traces/{divergent}").text
    assert _rerun_notes(html) == (False, True)


def test_the_re_run_note_says_a_margin_was_re_run(
    ui_client: Callable[..., TestClient],
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """Without a logged top-k, arm A's margin came from a re-run, and the page says so."""

    def without_top_k(prompt: list[int], **kw: Any) -> dict[str, Any]:
        return logged_trace(prompt, **kw) | {"top_k": None}

    run = seed_run(client, runner, headers("admin"), without_top_k, targets=[FP16])
    divergent = _divergent_trace(client, headers, run.run_id)
    html = ui_client().get(f"/ui/runs/{run.run_id}/traces/{divergent}").text
    assert _rerun_notes(html) == (True, False)


def _divergent_trace(
    client: TestClient, headers: Callable[..., dict[str, str]], run_id: str
) -> str:
    items = client.get(
        f"/v1/replays/{run_id}/results", params={"limit": 500}, headers=headers("auditor")
    ).json()["items"]
    row = next(x for x in items if x["comparison"] == 0 and x["first_divergence_step"] is not None)
    return str(row["trace_id"])
