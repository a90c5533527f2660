"""Fixtures for reports and the web UI: a real replay run, seeded over HTTP and replayed by the
real job with fake engines (tests/replays/conftest.py), whose engines also detokenize, so
answers are extracted and task accuracy exists.

The run (`seeded_run`): PROMPTS traces logged by the fake BF16 arm, each with a reference
answer (every third one deliberately wrong), one carrying `<script>` in its texts and
external id; targets FP16 (T0) and FP16 + C (T1), labelled with a `<script>` in T1's label;
compared with the logged output (comparisons 0: logged vs T0, 1: logged vs T1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import Settings
from replay_audit.engine import EnginePool, FakeEngine, Target
from replay_audit.worker import context
from tests.replays.conftest import (  # noqa: F401  (fixtures)
    VOCAB,
    HoldingRunner,
    all_results,
    bf16_next,
    fake_model_dir,
    fp16_next,
    ingest,
    logged_trace,
    runner,
)

#: Prompts of the seeded run: about half of them meet a close call within 12 tokens.
PROMPTS = [[i, (i * 5) % 11, 3] for i in range(1, 25)]
XSS = "<script>alert('xss')</script>"
FP16 = {"dtype": "fp16"}
FP16_C = {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3}, "label": f"C {XSS}"}


def piece(token: int) -> str:
    """The fake tokenizer: every token reads as a number, so the GSM8K extractor's answer of
    a text is its last token id."""
    return f" {token}"


def talking_loader(directory: Path, target: Target, _tp: int = 1) -> FakeEngine:
    fn = fp16_next if target.dtype == "fp16" else bf16_next
    return FakeEngine(
        target,
        next_token=fn,
        vocab_size=VOCAB,
        repair_fn=lambda context, _token: bf16_next(context)[0],
        pieces=piece,
    )


@pytest.fixture
def worker_env(
    monkeypatch: pytest.MonkeyPatch,
    db_url: str,
    fake_model_dir: Path,  # noqa: F811
) -> Iterator[EnginePool]:
    """Worker settings on the test database and a pool of fake engines that detokenize."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(fake_model_dir))
    pool = EnginePool(loader=talking_loader)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]  # from the env set above
    context.install_worker_context(context.WorkerContext(settings, pool))
    yield pool
    context.install_worker_context(None)


@dataclass(frozen=True)
class SeededRun:
    run_id: str
    trace_ids: list[str]
    #: The trace whose texts and external id carry a <script>.
    xss_trace_id: str
    project: str


def make_traces(
    logged_trace: Callable[..., dict[str, Any]],  # noqa: F811
    prompts: list[list[int]],
) -> list[dict[str, Any]]:
    traces = []
    for i, prompt in enumerate(prompts):
        body = logged_trace(prompt)
        last = body["output_token_ids"][-1]
        body["output_text"] = "".join(piece(t) for t in body["output_token_ids"])
        # Every third reference is wrong, so the logged arm is not always right.
        body["reference_answer"] = f"#### {last if i % 3 else last + 1}"
        body["external_id"] = f"ext-{i}"
        body["tags"] = ["production", f"batch-{i % 2}"]
        traces.append(body)
    traces[0]["prompt_text"] = f"Question {XSS}"
    traces[0]["output_text"] = traces[0]["output_text"] + f" {XSS}"
    traces[0]["external_id"] = f"ext-{XSS}"
    traces[0]["tags"] = ["=cmd", "production"]
    return traces


def seed_run(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: dict[str, str],
    logged_trace: Callable[..., dict[str, Any]],  # noqa: F811
    *,
    prompts: list[list[int]] | None = None,
    targets: list[dict[str, Any]] | None = None,
    **request: Any,
) -> SeededRun:
    """Ingest traces, create a run over them, replay it to the end; the run's ids."""
    ids = ingest(client, headers, make_traces(logged_trace, prompts or PROMPTS))
    body = {"trace_ids": ids, "targets": targets or [FP16, FP16_C], **request}
    r = client.post("/v1/replays", json=body, headers=headers)
    assert r.status_code in (200, 201), r.text
    runner.run_all()
    run_id = str(r.json()["id"])
    status = client.get(f"/v1/replays/{run_id}", headers=headers).json()["status"]
    assert status == "done", status
    return SeededRun(run_id=run_id, trace_ids=ids, xss_trace_id=ids[0], project="acme")


@pytest.fixture
def seeded_run(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],  # noqa: F811
    worker_env: EnginePool,
) -> SeededRun:
    return seed_run(client, runner, headers("admin"), logged_trace)
