"""Fixtures for the screening service: a runner that holds jobs until the test runs them (by
their dotted path, as a worker does), worker settings on the test database, and the fake
screening backend of tests/screenings/sweep/fake_screen.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import FakeEngine
from replay_audit.screenings import tasks
from replay_audit.screenings.sweep.outputs import ScreenPrompt
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig
from replay_audit.worker.checkpoint import CheckpointIndex
from tests.replays.conftest import (  # noqa: F401  (fixtures)
    HoldingRunner,
    fake_model_dir,
    worker_env,
)
from tests.screenings.sweep.fake_screen import FakeBackend

#: Keeps jobs until `run_all()`, then runs each by its dotted path.
JobRunner = HoldingRunner


@dataclasses.dataclass
class FakeWorkerBackend(FakeBackend):
    """The fake screening backend as a worker sees it: a CPU platform, fp32 checkpoint."""

    def platform(self) -> Platform:
        return Platform(device="cpu", fp8_unavailable="no fp8 on a cpu")

    def reference_dtype(self) -> str:
        return "fp32"

    def prompts(self, rows: Sequence[dict[str, Any]]) -> list[ScreenPrompt]:
        return [
            ScreenPrompt(str(r.get("id") or i), tuple(r["prompt_token_ids"]))
            for i, r in enumerate(rows)
        ]

    def load(self, config: ScreenConfig) -> FakeEngine:
        return super().load(config)


@pytest.fixture
def job_runner(client: TestClient, fake_model_dir: Path) -> JobRunner:  # noqa: F811
    """Holds the app's jobs; the app finds the fake checkpoint (and the bundled one)."""
    r = JobRunner()
    state = client.app.state  # type: ignore[attr-defined]
    state.queue = dataclasses.replace(state.queue, runner=r)
    state.checkpoints = CheckpointIndex([fake_model_dir, BUNDLED_MODEL_DIR])
    return r


def install_fake(backend: FakeWorkerBackend, built: list[FakeWorkerBackend]) -> None:
    """Screening jobs get `backend`'s facts and its fake engines: the worker context's pool
    is the backend's (the one engine seam); `built` holds the backend each job took."""
    from replay_audit.worker import context

    def factory(model_dir: Path, device: str | None) -> FakeWorkerBackend:
        built.append(backend)
        return backend

    tasks.install_facts_factory(factory)
    settings = context.worker_context().settings
    context.install_worker_context(context.WorkerContext(settings, backend.pool()))


@pytest.fixture
def fake_backend(worker_env: Any) -> Iterator[list[FakeWorkerBackend]]:  # noqa: F811
    """Screening jobs get fake engines; the list holds the backend of every job run."""
    built: list[FakeWorkerBackend] = []
    install_fake(FakeWorkerBackend(), built)
    yield built
    tasks.install_facts_factory(None)
