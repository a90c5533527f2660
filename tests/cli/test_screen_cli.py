"""`replay-audit screen` on the bundled checkpoint, on the CPU: a small sweep end to end (report
JSON and HTML), resumed from its stored state without decoding again, and bad options refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch  # noqa: F401  (the engine CLI needs it)
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.config import PACKAGE_DIR

runner = CliRunner()
MODEL = PACKAGE_DIR / "assets" / "tiny-llama"
PROMPTS = PACKAGE_DIR / "assets" / "prompts.jsonl"


def _screen(out: Path, *extra: str) -> object:
    return runner.invoke(
        app,
        [
            "screen",
            "--model", str(MODEL),
            "--prompts", str(PROMPTS),
            "--device", "cpu",
            "--limit", "2",
            "--max-new-tokens", "4",
            "--knobs", "body_dtype,tf32",
            "--threads", "1",
            "--out", str(out),
            *extra,
        ],
    )  # fmt: skip


@pytest.mark.slow
def test_screen_writes_a_report_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "screen"
    r = _screen(out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == 2 and report["platform"]["device"] == "cpu"
    knobs = {k["name"]: k for k in report["knobs"]}
    body = {v["label"]: v for v in knobs["body_dtype"]["values"]}
    assert set(body) == {"bf16", "fp16"}  # fp32 is the checkpoint's own dtype: the reference
    for v in body.values():
        assert v["status"] == "measured"
        assert v["comparison"]["ear"]["n"] == 2
        assert v["environment"]["dtype"] == v["config"]["dtype"]
    tf32 = knobs["tf32"]["values"][0]
    assert tf32["status"] == "not_available" and "CUDA" in tf32["reason"]
    assert report["tier"]["name"]
    assert len(report["trigger_density"]) >= 3
    assert all(len(d["per_prompt"]) == 2 for d in report["trigger_density"])
    html = (out / "report.html").read_text()
    assert "<svg" in html and "Recommended action" in html

    state = sorted((out / "state").iterdir())
    stamps = {p.name: p.stat().st_mtime_ns for p in state if p.name.startswith("run__")}
    assert len(stamps) == 5  # fp32, bf16, fp16, bf16+C, fp16+C: each run decoded once
    again = _screen(out)
    assert again.exit_code == 0, again.output
    # Resumed: no run was decoded (or written) again, and the report is the same.
    assert {
        p.name: p.stat().st_mtime_ns for p in (out / "state").iterdir() if p.name in stamps
    } == stamps
    assert json.loads((out / "report.json").read_text()) == report


def test_screen_refuses_bad_options(tmp_path: Path) -> None:
    r = _screen(tmp_path / "x", "--knobs", "warp_drive")
    assert r.exit_code == 2 and "unknown knob 'warp_drive'" in r.output
    r = _screen(tmp_path / "x", "--pair", "bf16")
    assert r.exit_code == 2 and "--pair" in r.output
    for degree in ("1", str(10**20), "two"):
        r = _screen(tmp_path / "x", "--tp-degree", degree)
        assert r.exit_code == 2 and "Invalid value for '--tp-degree'" in r.output, r.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = runner.invoke(
        app, ["screen", "--model", str(MODEL), "--prompts", str(empty), "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "holds no prompt" in r.output
