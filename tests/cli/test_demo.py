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
from replay_audit.engine.loading import usable_cores

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
    env.pop("OMP_NUM_THREADS", None)  # torch's own default, one thread per core
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
            served += [round(100 * c["ear"]["estimate"]) for c in body["statistics"]["comparisons"]]
            assert "aggregate" not in body  # one statistics object, no deprecated twin
            # The replays ran beside the API, which they left a core.
            items = client.get(
                f"/v1/replays/{run_id}/results", headers={"X-API-Key": summary["api_key"]}
            ).json()["items"]
            assert {i["arms"]["b"]["environment"]["extras"]["torch_threads"] for i in items} == {
                max(1, usable_cores() - 1)
            }
            if name == "logged":
                # The self-replay in the logged configuration reproduces every trace, and as a
                # reproducibility check it gets no lift: only FP16 + C over FP16 does.
                assert body["statistics"]["comparisons"][-1]["ear"]["estimate"] == 1.0
                assert [lf["comparison_b"] for lf in body["statistics"]["lifts"]] == [1]
            # Each run reproduced every trace first (the "logged" run's self-replay is its
            # check; the both-arms run added one), and the demo printed how many.
            reproduction = body["statistics"]["engine_reproduction"]["reproduced"]
            traces = body["statistics"]["comparisons"][0]["n"]
            assert reproduction["successes"] == reproduction["n"] == traces > 0
            assert (
                f"reproduced in their own logged configuration: {reproduction['n']} of "
                f"{reproduction['n']} traces" in proc.stdout
            )
    assert printed == served and len(served) == 6
    # Both lifts of C are printed with what they compare (once lost to rich markup).
    assert "EAR lift of [logged vs T1: FP16 + C] over [logged vs T0: FP16]" in proc.stdout
    assert "EAR lift of [T2: BF16 + C vs T3: FP16 + C] over [T0: BF16 vs T1: FP16]" in proc.stdout


KEY = re.compile(r"\bra_[0-9a-f]{12}_[A-Za-z0-9_-]{43}\b")


def test_demo_again_reuses_its_key_and_leaves_the_prompt_ids_to_the_user(tmp_path: Path) -> None:
    from tests.cli.conftest import assert_no_traceback, cli_env, run_cli

    args = ["demo", "--prompts", "2", "--max-new-tokens", "8"]
    first = run_cli(args, env=cli_env(), cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "new; kept in var/demo-api-key" in first.stdout
    again = run_cli(args, env=cli_env(), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_no_traceback(again)
    (key,) = set(KEY.findall(first.stdout))
    assert set(KEY.findall(again.stdout)) == {key}
    assert "reused from var/demo-api-key" in again.stdout
    assert (tmp_path / "var" / "demo-api-key").stat().st_mode & 0o777 == 0o600
    # The demo's URLs point at `serve`, not at the API that stopped with it.
    assert "this API has stopped" in again.stdout and "replay-audit serve" in again.stdout

    # The user's own traces of the bundled prompts, posted with that key, are theirs: no 409.
    from typer.testing import CliRunner

    from replay_audit.cli import app
    from replay_audit.config import BUNDLED_MODEL_DIR, PACKAGE_DIR

    traces = tmp_path / "traces.jsonl"
    r = CliRunner().invoke(
        app,
        ["generate", "--model", str(BUNDLED_MODEL_DIR), "--prompts",
         str(PACKAGE_DIR / "assets" / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8",
         "--out", str(traces), "--device", "cpu", "--threads", "1"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database_url=f"sqlite:///{tmp_path / 'var' / 'replay-audit.db'}"
    )
    body = {"traces": [json.loads(x) for x in traces.read_text().splitlines()]}
    with TestClient(create_app(settings)) as client:
        res = client.post("/v1/traces:batch", json=body, headers={"X-API-Key": key}).json()
        assert [item["status"] for item in res["results"]] == [201, 201], res
        listed = client.get("/v1/traces?limit=100", headers={"X-API-Key": key}).json()["items"]
    prompt_ids = [json.loads(x)["external_id"] for x in traces.read_text().splitlines()]
    # The second demo stored nothing new: the demo's two traces and the user's two.
    assert sorted(t["external_id"] for t in listed) == sorted(
        [*prompt_ids, *(f"demo-8tok-{i}" for i in prompt_ids)]
    )
