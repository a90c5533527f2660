"""Run `python -m replay_audit ...` as a user does: a fresh process, its own environment (none of
the caller's REPLAY_AUDIT_ settings), a working directory of its own.

    def test_x(tmp_path):
        proc = run_cli(["db", "upgrade"], env=cli_env(database_url=url), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert_no_traceback(proc)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: What a crash looks like on stderr: Python's and rich's tracebacks, and libstdc++'s abort.
CRASH_MARKERS = ("Traceback", "terminate called", "Aborted!")


def cli_env(**settings: str) -> dict[str, str]:
    """This process's environment without REPLAY_AUDIT_* variables, plus `settings` given as
    lower-case setting names (`database_url=...` sets REPLAY_AUDIT_DATABASE_URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env |= {"OMP_NUM_THREADS": "1"}  # a 2-core machine shared by parallel test runs
    env |= {f"REPLAY_AUDIT_{k.upper()}": v for k, v in settings.items()}
    return env


def cli_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "replay_audit", *args]


def run_cli(
    args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run one command to its end (bounded by `timeout`)."""
    return subprocess.run(
        cli_args(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def assert_no_traceback(proc: subprocess.CompletedProcess[str] | Any, output: str = "") -> None:
    text = output or f"{proc.stdout}{proc.stderr}"
    for marker in CRASH_MARKERS:
        assert marker not in text, text[-4000:]
