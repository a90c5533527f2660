"""torch's CPU threads: the setting REPLAY_AUDIT_TORCH_THREADS reaches `replay` and `generate`
(their --threads wins), and `serve`'s in-process runner leaves the API a core by default. Each
result records the count it ran with (`environment.extras.torch_threads`)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner

from replay_audit.cli import app
from replay_audit.engine.loading import set_torch_threads, usable_cores
from tests.cli.conftest import assert_no_traceback, cli_args, cli_env
from tests.cli.test_interrupt import KEY, Output, _bundled_model_traces, _free_port, _wait_healthy

runner = CliRunner()


@pytest.fixture
def torch_threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1: a command that set nothing would leave 2
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from replay_audit.engine.testing import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("threads")
    ckpt = make_tiny_checkpoint(d / "tiny")
    prompts = d / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    out = d / "traces.jsonl"
    r = runner.invoke(
        app,
        ["generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
         "--max-new-tokens", "8", "--device", "cpu", "--threads", "1"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return ckpt, out


def _replay(ckpt: Path, traces: Path, out: Path, *extra: str) -> list[dict[str, Any]]:
    r = runner.invoke(
        app,
        ["replay", str(traces), "--model", str(ckpt), "--dtype", "fp16", "--out", str(out),
         "--device", "cpu", *extra],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_set_torch_threads_leaves_free_what_it_is_asked(torch_threads_restored: None) -> None:
    assert set_torch_threads(None) == 2  # nothing asked: torch's count stays
    assert set_torch_threads(None, leave_free=1) == max(1, usable_cores() - 1)
    assert set_torch_threads(3, leave_free=1) == 3  # a count given wins


def test_replay_takes_the_setting_and_threads_wins(
    traces: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    torch_threads_restored: None,
) -> None:
    ckpt, file = traces
    monkeypatch.setenv("REPLAY_AUDIT_TORCH_THREADS", "1")
    for x in _replay(ckpt, file, tmp_path / "r1.jsonl"):
        assert x["arms"]["b"]["environment"]["extras"]["torch_threads"] == 1
    for x in _replay(ckpt, file, tmp_path / "r3.jsonl", "--threads", "3"):
        assert x["arms"]["b"]["environment"]["extras"]["torch_threads"] == 3


def test_generate_takes_the_setting(
    traces: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    torch_threads_restored: None,
) -> None:
    ckpt, _ = traces
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "one"}\n')
    monkeypatch.setenv("REPLAY_AUDIT_TORCH_THREADS", "1")
    r = runner.invoke(
        app,
        ["generate", "--model", str(ckpt), "--prompts", str(prompts), "--out",
         str(tmp_path / "t.jsonl"), "--max-new-tokens", "4", "--device", "cpu"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert torch.get_num_threads() == 1


def test_the_setting_is_a_positive_count() -> None:
    from replay_audit.config import Settings

    assert Settings(_env_file=None, torch_threads=2).torch_threads == 2  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="torch_threads"):
        Settings(_env_file=None, torch_threads=0)  # type: ignore[call-arg]


@pytest.mark.slow
def test_serve_leaves_the_api_a_core(tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = cli_env()
    env.pop("OMP_NUM_THREADS")  # torch's own default: one thread per core
    proc = subprocess.Popen(
        cli_args("serve", "--port", str(port), "--log-level", "warning"),
        cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    out, err = Output(proc.stdout), Output(proc.stderr)
    try:
        out.wait_for(KEY.pattern, proc, 120)
        h = {"X-API-Key": KEY.findall(out.text)[-1]}
        _wait_healthy(base, proc)
        r = httpx.post(f"{base}/v1/traces:batch", json={"traces": _bundled_model_traces(2)},
                       headers=h, timeout=60)  # fmt: skip
        assert r.status_code == 207, r.text
        ids = [item["id"] for item in r.json()["results"]]
        r = httpx.post(f"{base}/v1/replays", json={"trace_ids": ids,
                       "targets": [{"dtype": "fp16"}]}, headers=h, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        deadline = time.monotonic() + 240
        while httpx.get(f"{base}/v1/replays/{run_id}", headers=h).json()["status"] != "done":
            assert time.monotonic() < deadline and proc.poll() is None, err.text[-3000:]
            time.sleep(0.2)
        items = httpx.get(f"{base}/v1/replays/{run_id}/results", headers=h).json()["items"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        out.close()
        err.close()
    assert_no_traceback(None, out.text + err.text)
    assert len(items) == 4  # 2 traces x (the target + the reproduction check)
    for item in items:
        extras = item["arms"]["b"]["environment"]["extras"]
        assert extras["torch_threads"] == max(1, usable_cores() - 1), extras
