"""A command that cannot use its database says so in one line and exits with code 2 (no
traceback); on the embedded default (SQLite) a command that needs the schema applies the
migrations itself, as `serve` does. Each case runs in a fresh process, as a user meets it."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from replay_audit.db import migration
from tests.cli.conftest import assert_no_traceback, cli_env, run_cli

pytestmark = pytest.mark.slow

KEY = re.compile(r"\bra_[0-9a-f]{12}_[A-Za-z0-9_-]{43}\b")
#: A PostgreSQL URL whose port nobody listens on (and a password that must never be printed).
UNREACHABLE = "postgresql+psycopg://postgres:s3cret-pw@127.0.0.1:1/x"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line_error(args: list[str], url: str | None, cwd: Path) -> str:
    env = cli_env() if url is None else cli_env(database_url=url)
    proc = run_cli(args, env=env, cwd=cwd, timeout=120)
    assert proc.returncode == 2, f"{args} -> {proc.returncode}\n{proc.stdout}{proc.stderr}"
    assert_no_traceback(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines
    return lines[0]


def test_keys_create_in_a_fresh_directory_migrates_the_embedded_database(tmp_path: Path) -> None:
    proc = run_cli(
        ["keys", "create", "--project", "acme", "--role", "admin"], env=cli_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert KEY.fullmatch(proc.stdout.strip())
    url = f"sqlite:///{tmp_path / 'var' / 'replay-audit.db'}"
    assert migration.current_revision(url) == migration.head_revision()


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--port", "0"],
        ["keys", "create", "--project", "acme", "--role", "admin"],
        ["db", "upgrade"],
        ["db", "current"],
        ["reconcile"],
        ["audit", "list"],
        ["audit", "tick"],
        ["scheduler"],
        ["demo", "--prompts", "1"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_an_unreachable_database_is_one_line(args: list[str], tmp_path: Path) -> None:
    if args[0] == "serve":
        args = ["serve", "--port", str(_free_port())]
    line = _one_line_error(args, UNREACHABLE, tmp_path)
    assert "cannot connect to the database" in line and "127.0.0.1:1" in line, line
    assert "REPLAY_AUDIT_DATABASE_URL" in line
    assert "s3cret-pw" not in line


@pytest.mark.postgres
@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--no-migrate"],
        ["keys", "create", "--project", "acme", "--role", "admin"],
        ["reconcile"],
        ["audit", "list"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_a_postgres_database_without_the_schema_says_what_to_run(
    args: list[str], tmp_path: Path, empty_postgres_database: Callable[[], str]
) -> None:
    if args[0] == "serve":
        args = [*args, "--port", str(_free_port())]
    line = _one_line_error(args, empty_postgres_database(), tmp_path)
    assert "replay-audit db upgrade" in line, line


def test_a_sqlite_file_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    url = f"sqlite:///{blocker / 'replay-audit.db'}"
    line = _one_line_error(["keys", "create", "--project", "a", "--role", "admin"], url, tmp_path)
    assert str(blocker) in line, line


def test_a_file_that_is_not_a_database_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 100)
    line = _one_line_error(["audit", "list"], f"sqlite:///{path}", tmp_path)
    assert str(path) in line, line
    assert path.read_text().startswith("these are my notes")


def test_settings_that_do_not_parse_are_one_line(tmp_path: Path) -> None:
    env = cli_env(queue_prefix="not a prefix!", runner="rq")
    proc = run_cli(["audit", "tick"], env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: invalid settings: REPLAY_AUDIT_QUEUE_PREFIX"), line


def test_the_example_session_secret_is_refused_at_start(tmp_path: Path) -> None:
    """`.env.example` copied as is: `serve` stops at once, naming the setting and how to make
    one, instead of signing sessions with a key everyone has."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / ".env").write_text((root / ".env.example").read_text())
    proc = run_cli(["serve", "--port", "0"], env=cli_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    err = proc.stderr
    assert "REPLAY_AUDIT_SESSION_SECRET: still the placeholder of .env.example" in err
    assert "secrets.token_urlsafe(32)" in err and "Value error" not in err
    assert not (tmp_path / "var").exists()  # nothing was started or created


def test_scheduler_logs_every_tick(tmp_path: Path) -> None:
    """`replay-audit scheduler` says what each tick did, even when nothing was due (an operator
    sees it alive), and stops cleanly on SIGTERM."""
    import signal
    import subprocess
    import time

    from tests.cli.conftest import cli_args
    from tests.cli.test_interrupt import Output

    proc = subprocess.Popen(
        cli_args("scheduler", "--interval-s", "0.2"), cwd=tmp_path, env=cli_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    out = Output(proc.stdout)
    try:
        deadline = time.monotonic() + 120
        while out.text.count("audit tick:") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, out.text[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, out.text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    assert_no_traceback(None, out.text)
    assert "audit scheduler: a tick every 0.2 s" in out.text
    assert re.search(
        r"audit tick: 0 schedules due, 0 runs started, 0 evaluated \(0 flagged for "
        r"drift\), 0 alert deliveries enqueued, 0 jobs reconciled, 0 partitions "
        r"created, 0 traces pruned, 0 screenings pruned, 0 errors",
        out.text,
    ), out.text
