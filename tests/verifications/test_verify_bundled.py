"""Issue 23 on the bundled model: BF16- and FP16-logged traces of it verify `consistent`
against it, traces of a 4-bit RTN copy that claims to be it verify `inconsistent`: through the
verification itself and through `replay-audit verify` (offline, --json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool
from replay_audit.replays.domain import LoggedTrace
from replay_audit.stats.verification import Calibration
from replay_audit.verifications.domain import claim_key, claim_target
from replay_audit.verifications.run import verify


def _calibration_for(calibrations: list[Calibration]) -> Any:
    return lambda claim: next(c for c in calibrations if c.claim == claim)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("provider", "expected"),
    [("bf16", "consistent"), ("fp16", "consistent"), ("rtn4", "inconsistent")],
)
def test_verdict_of_each_provider(
    provider: str,
    expected: str,
    logged: dict[str, list[dict[str, Any]]],
    calibrations: list[Calibration],
    verify_pool: EnginePool,
) -> None:
    traces = [LoggedTrace.from_json(t) for t in logged[provider]]
    result = verify(traces, BUNDLED_MODEL_DIR, verify_pool, _calibration_for(calibrations))
    (group,) = result.groups
    assert group.result.verdict == expected, group
    assert group.result.tokens == sum(t.output_token_ids.size for t in traces)
    claim = claim_key(claim_target(traces[0].config))
    assert claim["dtype"] == logged[provider][0]["config"]["dtype"]
    if expected == "inconsistent":
        assert group.result.score > group.result.threshold
        assert group.result.effect_size > 0 and group.result.closest_benign is not None
        assert any(e.worst for e in result.evidence)
    else:
        assert group.result.tokens >= (group.result.tokens_needed or 10**9)


@pytest.mark.slow
def test_the_cli_verifies_offline_as_json(
    tmp_path: Path, logged: dict[str, list[dict[str, Any]]], calibrations: list[Calibration]
) -> None:
    cal = tmp_path / "null.json"
    cal.write_text(json.dumps([c.to_json() for c in calibrations]))
    runner = CliRunner()
    for providers, verdict, code in (
        (("bf16", "fp16"), "consistent", 0),
        (("rtn4",), "inconsistent", 1),
    ):
        path = tmp_path / f"{'-'.join(providers)}.jsonl"
        path.write_text("".join(json.dumps(t) + "\n" for p in providers for t in logged[p]))
        args = ["verify", str(path), "--model", str(BUNDLED_MODEL_DIR), "--calibration", str(cal)]
        res = runner.invoke(app, [*args, "--json", "--device", "cpu"])
        assert res.exit_code == code, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["verdict"] == verdict
        assert out["false_alarm_rate"] == 0.01
        assert out["tokens"] == sum(
            len(t["output_token_ids"]) for p in providers for t in logged[p]
        )
        assert len(out["groups"]) == len(providers)  # one group per claimed configuration
        assert (out["score"] > out["threshold"]) == (verdict == "inconsistent")


@pytest.mark.parametrize("command", ["calibrate", "verify"])
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--null-prompts", "1"),  # a null needs at least 2 prompts
        ("--null-prompts", str(10**12)),
        ("--null-prompts", "many"),
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", str(10**12)),
        ("--max-new-tokens", "long"),
    ],
)
def test_the_null_options_are_bounded(
    tmp_path: Path, command: str, option: str, value: str
) -> None:
    """Refused before anything loads, naming the option."""
    traces = tmp_path / "t.jsonl"
    traces.write_text("")
    args = [command, *([str(traces)] if command == "verify" else [])]
    res = CliRunner().invoke(app, [*args, "--model", str(BUNDLED_MODEL_DIR), option, value])
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output, res.output
