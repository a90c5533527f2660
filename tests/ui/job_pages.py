"""A done screening and a done verification stored as their jobs store them (the screening's
report from the fake sweep of tests/screenings/sweep/fake_screen.py), for the page tests."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from replay_audit.auth.models import Project
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.screenings.models import Screening
from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.density import covering_tau
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.runner import MemoryStore
from replay_audit.verifications.models import Verification
from tests.screenings.sweep.fake_screen import STEPS, FakeBackend, prompts

#: A sweep label as long as a real screening's (the chart cut it with an ellipsis at 1280 px).
LONG_LABEL = "fp16-stored, fp32 compute, deterministic algorithms off, batch 8"


def _screening_report() -> dict[str, Any]:
    plan = build_plan(
        Platform(device="cpu"),
        reference=ScreenConfig("fp32"),
        knobs=("body_dtype", "lm_head", "weight_storage", "attn_kernel", "batch_size"),
        max_new_tokens=STEPS,
    )
    out = FakeBackend().run(plan, prompts(), MemoryStore())
    report = build_report(plan, prompts(), out, model="fake-model", weights_sha256="ab" * 32)
    data = report.model_dump(mode="json")
    data["knobs"][2]["values"][1]["label"] = LONG_LABEL
    # The flips of one format were exact ties: the τ covering them is the float after 0.
    data["tau_calibration"][1]["tau"] = covering_tau([0.0, 0.0, 0.0], 0.9)
    return data


def _verification_report() -> dict[str, Any]:
    """Twelve traces: ten honest ones (no worst token), two with worst tokens."""
    traces: list[dict[str, Any]] = [
        {"trace": f"tr_{i:024d}", "tokens": 120, "sampled": False, "error": None, "worst": []}
        for i in range(12)
    ]
    worst = [
        {
            "step": s,
            "logged": 1234,
            "reference": 4321,
            "deficit": 0.5,
            "deficit_ulps": 3.0,
            "rank": 2,
        }
        for s in (4, 17)
    ]
    traces[:2] = [{**t, "worst": worst} for t in traces[:2]]
    quantiles = [0.1 * i for i in range(21)]
    group = {
        "group": "provider-x (tag)",
        "verdict": "inconsistent",
        "score": 2.5,
        "threshold": 1.2,
        "false_alarm_rate": 0.01,
        "tokens": 1440,
        "tokens_needed": 400,
        "closest_benign": "bf16 / head bf16 / sdpa",
        "sampled": 0,
        "null_quantiles": quantiles,
        "notes": [],
    }
    return {
        "verdict": "inconsistent",
        "tokens": 1440,
        "sampled": 0,
        "groups": [group],
        "traces": traces,
        "calibrations": [],
        "scanning_platform": {"device": "cpu", "gpu_name": None},
        "claimed_platforms": ["cpu"],
    }


def seed_jobs(db_url: str) -> tuple[str, str]:
    """A done screening and a done verification in project acme: their public ids."""
    with session_scope(db_url) as s:
        project = s.scalar(select(Project).where(Project.name == "acme"))
        assert project is not None
        now = utcnow()
        common = {"project_id": project.id, "status": "done", "request": {}, "finished_at": now}
        s.add(
            Screening(
                public_id="sc_layout", model_sha256="ab" * 32, report=_screening_report(), **common
            )
        )
        s.add(
            Verification(
                public_id="vf_layout",
                model_sha256="ab" * 32,
                selection={},
                report=_verification_report(),
                **common,
            )
        )
    return "sc_layout", "vf_layout"
