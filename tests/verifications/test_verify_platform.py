"""Issue 34: platforms are part of the claim. The report names the scanning platform and each
group's logged platform(s), and says whether the null covers that pair: a null is generated
and scanned on the scanning platform, so traces logged on another device kind or GPU are a
pair it never measured (`null_covers_platform: false`, a note naming both). Through the pure
report, `replay-audit verify` without --calibration (which measures a small null here, with
its progress on stderr) and the service's stored report and page, on both databases."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.stats.verification import CANDIDATES, Calibration, verdict
from replay_audit.verifications.domain import (
    GroupReport,
    cover_platforms,
    judge_group,
    platform_label,
    report_json,
)
from tests.replays.conftest import HoldingRunner
from tests.ui.conftest import settings as settings  # fixture: the session secret
from tests.ui.conftest import ui_client  # noqa: F401  (fixture)
from tests.verifications.conftest import store, verify

H200 = {"name": "NVIDIA H200", "sm": "9.0"}


def _providers(logged: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Two providers' BF16 traces by tag: one logged on this CPU, one whose config says an
    H200 (traces of other prompts)."""
    h200 = copy.deepcopy(logged["bf16"][4:8])
    for t in h200:
        t["config"] |= {"device": "cuda", "gpu": H200}
    return {"cpu-provider": logged["bf16"][:4], "h200-provider": h200}


def _platform_groups(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The CPU provider's group and the H200 one's, once the report is checked to name the
    scanning platform, both logged ones, and that the null (measured here) covers only the
    first."""
    assert report["scanning_platform"]["device"] == "cpu"
    assert report["claimed_platforms"] == ["cpu", "cuda (NVIDIA H200)"]
    groups = {g["group"].split(" ")[0]: g for g in report["groups"]}
    here, there = groups["cpu-provider"], groups["h200-provider"]
    assert here["null_covers_platform"] is True and here["logged_platforms"] == ["cpu"]
    assert there["null_covers_platform"] is False and there["null_platform"] == "cpu"
    assert there["logged_platforms"] == ["cuda (NVIDIA H200)"]
    return here, there


def test_the_report_names_both_platforms_and_whether_the_null_covers_them(
    calibrations: list[Calibration],
) -> None:
    cal = calibrations[0]
    assert cal.platform["device"] == "cpu"
    base = GroupReport("g", verdict([], cal), 0, 0, (), null_platform="cpu")
    groups = [base, GroupReport("h", base.result, 0, 0, (), null_platform="cpu")]
    logged = {"g": ["cpu", "cpu"], "h": ["cuda (NVIDIA H200)", "cpu"]}
    same, other = cover_platforms(groups, logged, "cpu")
    assert same.null_covers_platform is True and same.logged_platforms == ("cpu",)
    assert not same.notes
    assert other.null_covers_platform is False
    assert other.logged_platforms == ("cpu", "cuda (NVIDIA H200)")
    (note,) = other.notes
    assert "cuda (NVIDIA H200)" in note and "measured on cpu" in note
    # Scanned elsewhere than the null was measured (a calibration file from another machine).
    (moved,) = cover_platforms([base], {"g": ["cpu"]}, "cuda (NVIDIA H100)")
    assert moved.null_covers_platform is False and "scanned on cuda (NVIDIA H100)" in moved.notes[0]
    out = report_json([same, other], [])
    assert [g["null_covers_platform"] for g in out["groups"]] == [True, False]
    assert out["groups"][1]["logged_platforms"] == ["cpu", "cuda (NVIDIA H200)"]
    assert out["groups"][1]["null_platform"] == "cpu"
    assert platform_label("cuda", "NVIDIA H200") == "cuda (NVIDIA H200)"
    # The null's platform comes from the calibration the group is judged against.
    assert judge_group("g", [], cal).null_platform == "cpu"


@pytest.mark.slow
def test_verify_without_a_calibration_measures_the_null_and_reports_platforms_and_reach(
    tmp_path: Path, logged: dict[str, list[dict[str, Any]]]
) -> None:
    path = tmp_path / "traces.jsonl"
    tagged = [t | {"tags": [tag]} for tag, ts in _providers(logged).items() for t in ts]
    path.write_text("".join(json.dumps(t) + "\n" for t in tagged))
    args = ["verify", str(path), "--model", str(BUNDLED_MODEL_DIR), "--device", "cpu"]
    small = ["--null-prompts", "3", "--max-new-tokens", "12", "--threads", "1"]
    res = CliRunner().invoke(app, [*args, *small, "--json", "--group-by", "tag"])
    assert res.exit_code in (0, 3), res.output
    # Its progress, a line a step where stderr is no terminal: each variation, the end.
    assert "benign null of" in res.stderr and "4-bit alternative" in res.stderr
    here, there = _platform_groups(json.loads(res.stdout.strip().splitlines()[-1]))
    assert any("cuda (NVIDIA H200)" in n and "cpu" in n for n in there["notes"])
    # A null of 3 prompts x 12 tokens backs no group of ~190 tokens: each says so.
    for g in (here, there):
        assert g["tokens"] > 36 and g["null_reach"] is not None and g["null_reach"] <= 36
        assert g["beyond_null_reach"] is True
        assert any("more than the null backs" in n for n in g["notes"])
        assert g["decision"] in CANDIDATES  # the decision chosen at its budget
        assert "decided_by" in g


@pytest.mark.slow
def test_the_service_report_and_page_name_the_platforms(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
    ui_client: Callable[..., TestClient],  # noqa: F811
) -> None:
    admin = headers("admin")
    for tag, traces in _providers(logged).items():
        store(client, admin, traces, tag)
    got = verify(client, admin, job_runner, filter={"tags": []}, group_by="tag")
    report = got["report"]
    _platform_groups(report)
    cal = report["calibrations"][0]
    assert cal["reach"] is not None and cal["decision"] == "per_budget" and cal["rule"]
    # Each group reports what decided it: the decision its calibration chose at its budget.
    chosen = {c["tokens"]: c["decision"] for c in cal["choices"]}
    assert [c["tokens"] for c in cal["choices"]] == [b["tokens"] for b in cal["budgets"]]
    for g in report["groups"]:
        assert g["decision"] == chosen[g["budget"]], (g["budget"], g["decision"])
    page = ui_client("auditor").get(f"/ui/verifications/{got['id']}")
    assert page.status_code == 200, page.text
    assert "logged on cuda (NVIDIA H200), scanned against a null measured on cpu" in page.text
    assert "the null does not cover this pair" in page.text
    assert "logged on cpu, scanned against a null measured on cpu" in page.text
    assert "the null covers this pair" in page.text
