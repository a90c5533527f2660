"""Ctrl-C during `replay-audit replay`: a real process gets SIGINT mid-file, says how many
results it wrote where, keeps them with their summary, and `--resume` replays only the rest, to
the same file and the same summary an uninterrupted run gives."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.words import counted
from tests.cli.conftest import assert_no_traceback, cli_args, cli_env

pytestmark = pytest.mark.slow
runner = CliRunner()
N_TRACES = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from replay_audit.engine.testing import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("resume")
    ckpt = make_tiny_checkpoint(d / "tiny")
    prompts = d / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"prompt {i}: "}) + "\n" for i in range(N_TRACES)
        )
    )
    traces = d / "traces.jsonl"
    r = runner.invoke(
        app,
        ["generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(traces),
         "--dtype", "bf16", "--max-new-tokens", "16", "--device", "cpu", "--threads", "1"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return ckpt, traces


def _replay_args(ckpt: Path, traces: Path, out: Path, summary: Path) -> list[str]:
    return ["replay", str(traces), "--model", str(ckpt), "--dtype", "fp16", "--out", str(out),
            "--summary-json", str(summary), "--device", "cpu", "--threads", "1"]  # fmt: skip


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _figures(summary: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in summary.items() if k != "interrupted"}


def test_ctrl_c_keeps_the_results_and_resume_finishes(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, traces = setup
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    proc = subprocess.Popen(
        cli_args(*_replay_args(ckpt, traces, out, summary)),
        env=cli_env(), cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    assert_no_traceback(None, stdout + stderr)

    written = _lines(out)
    # Stopped mid-file between traces: every line whole, each trace's two comparisons (the
    # target's and the reproduction check) written together.
    done = sorted({str(x["trace_id"]) for x in written})
    assert 1 <= len(done) < N_TRACES and len(written) == 2 * len(done)
    assert f"interrupted: {counted(len(done), 'trace')} written to {out}" in stderr
    assert "--resume" in stderr
    s = json.loads(summary.read_text())
    assert s["interrupted"] is True and s["n"] == len(done) and s["traces"] == N_TRACES
    assert "EAR" in stdout  # the summary of what was done is printed too

    r = runner.invoke(app, [*_replay_args(ckpt, traces, out, summary), "--resume"])
    assert r.exit_code == 0, r.output
    resumed = _lines(out)
    assert resumed[: len(written)] == written  # kept as they were, not replayed again
    assert [(x["trace_id"], x["comparison"]) for x in resumed] == [
        (f"p{i}", c) for i in range(N_TRACES) for c in (0, 1)
    ]
    assert f"wrote the results of {N_TRACES} traces to {out}" in r.output
    after_resume = json.loads(summary.read_text())
    assert after_resume["interrupted"] is False and after_resume["n"] == N_TRACES

    # The same file and statistics as one uninterrupted run.
    whole, whole_summary = tmp_path / "whole.jsonl", tmp_path / "whole.json"
    r = runner.invoke(app, _replay_args(ckpt, traces, whole, whole_summary))
    assert r.exit_code == 0, r.output
    assert _lines(whole) == resumed
    assert _figures(json.loads(whole_summary.read_text())) == _figures(after_resume)


def test_resume_refuses_a_file_of_another_target(setup: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, traces = setup
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    head = tmp_path / "head.jsonl"
    head.write_text("".join(traces.read_text().splitlines(keepends=True)[:2]))
    r = runner.invoke(app, _replay_args(ckpt, head, out, summary))
    assert r.exit_code == 0, r.output
    args = _replay_args(ckpt, traces, out, summary)
    args[args.index("fp16")] = "bf16"
    r = runner.invoke(app, [*args, "--resume"])
    assert r.exit_code == 2 and f"{out}:1: a result of another target" in r.output


def test_resume_drops_a_line_cut_short(setup: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, traces = setup
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    head = tmp_path / "head.jsonl"
    head.write_text("".join(traces.read_text().splitlines(keepends=True)[:3]))
    r = runner.invoke(app, _replay_args(ckpt, head, out, summary))
    assert r.exit_code == 0, r.output
    full = out.read_text()
    out.write_text(full[: full.rindex("\n", 0, len(full) - 1) + 40])  # a SIGKILL mid-write
    r = runner.invoke(app, [*_replay_args(ckpt, head, out, summary), "--resume"])
    assert r.exit_code == 0, r.output
    assert out.read_text() == full
