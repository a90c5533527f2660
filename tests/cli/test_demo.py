"""`replay-audit demo`, the README's main job, on the embedded default with the bundled model:
it finishes, and the EAR it prints is the one the API serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.config import Settings

pytestmark = pytest.mark.slow


def test_demo_prints_what_the_api_serves(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    env = {
        **os.environ,
        "REPLAY_AUDIT_DATABASE_URL": f"sqlite:///{db}",
        "REPLAY_AUDIT_RUNNER": "inprocess",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
    }
    env.pop("REPLAY_AUDIT_MODEL_DIRS", None)
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay_audit",
            "demo",
            "--prompts",
            "6",
            "--max-new-tokens",
            "24",
            "--json-out",
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = [int(x) for x in re.findall(r"│\s*(\d+)% \[\d+, \d+\]", proc.stdout)]
    summary = json.loads(out.read_text())

    settings = Settings(_env_file=None, database_url=f"sqlite:///{db}")  # type: ignore[call-arg]
    served = []
    with TestClient(create_app(settings)) as client:
        for name in ("logged", "both_arms"):
            run_id = summary["runs"][name]["id"]
            run = client.get(f"/v1/replays/{run_id}", headers={"X-API-Key": summary["api_key"]})
            assert run.status_code == 200
            body = run.json()
            assert body["status"] == "done"
            served += [
                round(100 * c["ear"]["estimate"]) for c in body["statistics"]["comparisons"]
            ]
            # The deprecated aggregate says the same figures.
            assert [c["ear"] for c in body["aggregate"]["comparisons"]] == [
                c["ear"] for c in body["statistics"]["comparisons"]
            ]
            if name == "logged":
                # The self-replay in the logged configuration reproduces every trace, and as a
                # reproducibility check it gets no lift: only FP16 + C over FP16 does.
                assert body["statistics"]["comparisons"][-1]["ear"]["estimate"] == 1.0
                assert [lf["comparison_b"] for lf in body["statistics"]["lifts"]] == [1]
    assert printed == served and len(served) == 5
    # Both lifts of C are printed with what they compare (once lost to rich markup).
    assert "EAR lift of [logged vs T1: FP16 + C] over [logged vs T0: FP16]" in proc.stdout
    assert "EAR lift of [T2: BF16 + C vs T3: FP16 + C] over [T0: BF16 vs T1: FP16]" in proc.stdout
