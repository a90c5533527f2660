"""The README's shell snippets run as written: the blocks marked `<!-- runnable: ... -->` before
their fence ("Post a trace", then "Replay runs", in one shell), from the checkout, against a
fresh `replay-audit serve` on the embedded default.

Only two things differ from a reader's shell: the server listens on a free port instead of
8000 (the snippets' `127.0.0.1:8000` is rewritten to it), and `replay-audit` on the PATH is this
checkout's code run by this interpreter; the database is a temporary file named by
REPLAY_AUDIT_DATABASE_URL for both the server and the snippets, so nothing lands in the checkout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cli.conftest import assert_no_traceback, cli_args, cli_env
from tests.cli.test_interrupt import Output, _free_port, _wait_healthy

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: `<!-- runnable: NAME (a note) -->` right above a bash fence.
RUNNABLE = re.compile(
    r"<!-- runnable: (?P<name>[^(>]*?)\s*(?:\([^)]*\))? -->\n```(?:bash|sh)\n(?P<body>.*?)\n```\n",
    re.S,
)


def runnable_blocks() -> list[tuple[str, str]]:
    return [(m["name"], m["body"]) for m in RUNNABLE.finditer(README.read_text())]


def test_the_flow_is_marked_runnable() -> None:
    assert [name for name, _ in runnable_blocks()] == ["post a trace", "replay runs"]
    # A marker must sit right above its fence: none is left unmatched.
    assert README.read_text().count("<!-- runnable:") == len(runnable_blocks())


@pytest.mark.slow
def test_post_a_trace_and_replay_it_as_written(tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "replay-audit"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m replay_audit "$@"\n')
    shim.chmod(0o755)
    env = cli_env(database_url=f"sqlite:///{tmp_path / 'readme.db'}")
    env["PATH"] = f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("REPLAY_AUDIT_API_KEY", None)

    server = subprocess.Popen(
        cli_args("serve", "--port", str(port), "--log-level", "warning"),
        cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert server.stdout is not None
    log = Output(server.stdout)
    try:
        _wait_healthy(base, server)
        script = "\n".join(body for _, body in runnable_blocks())
        script = script.replace("http://127.0.0.1:8000", base)
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert '"status":201,"id":"tr_' in out and '"created":true' in out, out
        (run_id,) = set(re.findall(r'"id":"(rr_[^"]+)"', out))
        assert '"items":[' in out  # the results answered, for the reader's key

        # The run the reader started finishes on the in-process runner.
        key = subprocess.run(
            cli_args("keys", "create", "--project", "default", "--role", "auditor"),
            env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        deadline = time.monotonic() + 240
        while _status(base, run_id, key) != "done":
            assert time.monotonic() < deadline and server.poll() is None, log.text[-3000:]
            time.sleep(0.5)
        # The trace was logged with `eager` and the targets name no kernel: both arms of every
        # pairwise comparison ran the logged kernel, and so did the reproduction check the run
        # added (comparison 2: the logged configuration against the logged tokens).
        results = httpx.get(f"{base}/v1/replays/{run_id}/results", headers={"X-API-Key": key})
        items = sorted(results.json()["items"], key=lambda x: x["comparison"])
        assert [x["comparison"] for x in items] == [0, 1, 2], items
        assert all(x["status"] == "ok" for x in items), items
        for x in items:
            for arm in ("a", "b") if x["comparison"] < 2 else ("b",):
                resolved = x["arms"][arm]["resolved"]
                assert resolved["attn_kernel"] == "eager" and resolved["kernel_source"] == "logged"
                assert x["arms"][arm]["environment"]["attn_kernel"] == "eager"
                assert x["arms"][arm]["target"]["attn_kernel"] == "eager"
        # The README's trace is written by hand, not generated: its logged tokens do not
        # reproduce, and every result of the run says so.
        assert items[2]["exact_match"] is False and items[2]["first_divergence_step"] == 0
        assert all(x["engine_reproduced"] is False for x in items)
        run = httpx.get(f"{base}/v1/replays/{run_id}", headers={"X-API-Key": key}).json()
        ran = {
            (r["a"]["attn_kernel"] if r["a"] else None, r["b"]["attn_kernel"]) for r in run["ran"]
        }
        assert ran == {("eager", "eager"), (None, "eager")}, run["ran"]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert_no_traceback(None, log.text + proc.stderr)


def _status(base: str, run_id: str, key: str) -> str:
    body = httpx.get(f"{base}/v1/replays/{run_id}", headers={"X-API-Key": key}).json()
    return str(body["status"])
