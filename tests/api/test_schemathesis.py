"""Schemathesis (an OpenAPI fuzzer) against the running app, with every check: no server
error, and every answer as the OpenAPI document says (status, body, headers, Allow), every
schema-valid request accepted and every invalid one refused. On SQLite and on PostgreSQL.

It runs the `st` command line, exactly as a developer would, against a real uvicorn serving
the app with an admin key of its own. The seed is fixed and the time budget bounded (about
45 s a database on the 2-core CI machine); what the document cannot state is in
tests/api/schemathesis.toml, with the rule each exception stands for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from replay_audit.api.app import create_app
from replay_audit.config import Settings
from replay_audit.engine import EnginePool
from replay_audit.worker import context
from tests.api.conftest import ServeApp
from tests.conftest import ApiKeyFactory
from tests.replays.conftest import fake_loader

CONFIG = Path(__file__).with_name("schemathesis.toml")
SEED = 20240501
#: Seconds of fuzzing and stateful testing per database (the coverage phase runs first), and
#: examples per operation; a longer run: REPLAY_AUDIT_TEST_SCHEMATHESIS_S=200 and _EXAMPLES=100.
MAX_TIME_S = int(os.environ.get("REPLAY_AUDIT_TEST_SCHEMATHESIS_S", "40"))
MAX_EXAMPLES = int(os.environ.get("REPLAY_AUDIT_TEST_SCHEMATHESIS_EXAMPLES", "15"))


@pytest.fixture
def served(settings: Settings, serve: ServeApp) -> Iterator[tuple[str, int]]:
    """The app behind uvicorn; the replays the fuzzer starts run on the test database with
    fake engines (they fail: no checkpoint has the fuzzer's weights_sha256)."""
    context.install_worker_context(context.WorkerContext(settings, EnginePool(loader=fake_loader)))
    try:
        with serve(create_app(settings)) as address:
            yield address
    finally:
        context.install_worker_context(None)


@pytest.mark.slow
def test_the_api_conforms_to_its_openapi_document(
    served: tuple[str, int], api_key: ApiKeyFactory, tmp_path: Path
) -> None:
    host, port = served
    command = [
        str(Path(sys.executable).with_name("st")),
        "--config-file",
        str(CONFIG),
        "run",
        f"http://{host}:{port}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"X-API-Key: {api_key('admin')}",
        "--seed",
        str(SEED),
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(MAX_TIME_S),
        "--workers",
        "1",
        "--continue-on-failure",
        "--generation-database",
        "none",
        "--report-dir",
        str(tmp_path),
    ]
    environment = os.environ | {"NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"}
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=MAX_TIME_S * 6,
        env=environment,
        cwd=tmp_path,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20_000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", output)
    # Every operation fuzzed at least twice on average (24 operations): on a loaded 2-core
    # machine the time budget, not the example cap, ends the run (49 cases seen under load 6;
    # about 150 on an idle machine).
    assert counts is not None and counts[1] == counts[2], output[-5_000:]
    assert int(counts[1]) >= 48, output[-5_000:]
