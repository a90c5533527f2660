"""Fixtures for replay runs: a fake "model" in two formats, traces logged by its BF16 arm, a
checkpoint directory the worker finds by weights_sha256, and a runner that holds jobs until the
test runs them.

The fake model: the next token is a hash of the context with a comfortable margin, except at
"close calls" (contexts whose sum is divisible by 7) where the margin is 5e-4, below the paper's
τ = 1e-3, and the FP16 arm picks the runner-up. Intervention C picks what BF16 picks there, so it
repairs every such flip; the flip also reproduces from scratch (head_reachable).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine import EnginePool, FakeEngine, Intervention, Target, weights_sha256
from replay_audit.queue import JobSpec
from replay_audit.queue.runner import resolve
from replay_audit.worker import context
from tests.conftest import RedisNamespace, empty_all_tables

VOCAB = 97
CLOSE_MARGIN = 5e-4

# The engine's checkpoints and pool, for the replayer's tests against real torch engines.
from tests.engine.conftest import (  # noqa: E402, F401
    _one_torch_thread,
    pool,
    real_dir,
    real_prompts,
    tiny_dir,
)


def _close(context: tuple[int, ...]) -> bool:
    return sum(context) % 7 == 0


def bf16_next(context: tuple[int, ...]) -> tuple[int, float]:
    token = (sum(context) * 31 + len(context)) % VOCAB
    return token, CLOSE_MARGIN if _close(context) else 1.0


def fp16_next(context: tuple[int, ...]) -> tuple[int, float]:
    token, margin = bf16_next(context)
    return ((token + 1) % VOCAB, margin) if _close(context) else (token, margin)


def fake_loader(directory: Path, target: Target, _tp: int = 1) -> FakeEngine:
    fn = fp16_next if target.dtype == "fp16" else bf16_next
    return FakeEngine(
        target,
        next_token=fn,
        vocab_size=VOCAB,
        repair_fn=lambda context, _token: bf16_next(context)[0],
    )


class HoldingRunner:
    """A runner that keeps jobs until `run_all()` (or drops them, like a flushed Redis), then
    runs each by its dotted path, as a worker does (replay jobs, screening jobs)."""

    def __init__(self) -> None:
        self.specs: list[JobSpec] = []

    def enqueue(self, spec: JobSpec) -> None:
        if all(s.job_id != spec.job_id for s in self.specs):
            self.specs.append(spec)

    def is_queued(self, job_id: str) -> bool:
        return any(s.job_id == job_id for s in self.specs)

    def ping(self) -> None:
        """Always takes work (the test runs it)."""

    def run_all(self) -> int:
        n = 0
        while self.specs:
            spec = self.specs.pop(0)
            resolve(spec.func)(*spec.args)
            n += 1
        return n


@pytest.fixture
def fake_model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "fake-model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"fake weights for the fake engine")
    config = {"vocab_size": VOCAB, "max_position_embeddings": 1024}  # what bounds a screening
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def runner(client: TestClient) -> HoldingRunner:
    """The app's queue with a `HoldingRunner`: jobs wait until the test runs them."""
    r = HoldingRunner()
    app_state = client.app.state  # type: ignore[attr-defined]
    app_state.queue = dataclasses.replace(app_state.queue, runner=r)
    return r


@pytest.fixture
def worker_env(
    monkeypatch: pytest.MonkeyPatch, db_url: str, fake_model_dir: Path
) -> Iterator[EnginePool]:
    """Worker settings on the test database and a pool of fake engines."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(fake_model_dir))
    fake_pool = EnginePool(loader=fake_loader)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]  # from the env set above
    context.install_worker_context(context.WorkerContext(settings, fake_pool))
    yield fake_pool
    context.install_worker_context(None)


@pytest.fixture
def logged_trace(fake_model_dir: Path) -> Callable[..., dict[str, Any]]:
    """logged_trace(prompt, n=12, **overrides) -> a trace the BF16 fake arm really produced."""
    sha = weights_sha256(fake_model_dir)

    def make(prompt: list[int], n: int = 12, **overrides: Any) -> dict[str, Any]:
        engine = fake_loader(fake_model_dir, Target("bf16"))
        run = engine.decode(prompt, n, (), Intervention(), top_k=2)
        body: dict[str, Any] = {
            "model": {"name": "fake", "weights_sha256": sha, "vocab_size": VOCAB},
            "config": {"dtype": "bf16", "attn_kernel": "sdpa", "device": "cpu"},
            "decoding": {"strategy": "greedy", "max_new_tokens": n, "stop_reason": "length"},
            "prompt_token_ids": prompt,
            "output_token_ids": run.output_token_ids,
            "top_k": {
                "ids": run.steps.top_k_ids.tolist(),
                "logits": run.steps.top_k_logits.astype(float).tolist(),
            },
            "tags": ["production"],
        }
        body.update(overrides)
        return body

    return make


def ingest(client: TestClient, headers: dict[str, str], traces: list[dict[str, Any]]) -> list[str]:
    """POST the traces as one batch; their ids (every item must be stored)."""
    r = client.post("/v1/traces:batch", json={"traces": traces}, headers=headers)
    assert r.status_code == 207, r.text
    items = r.json()["results"]
    assert all(i["status"] in (200, 201) for i in items), items
    return [str(i["id"]) for i in items]


def all_results(
    client: TestClient, run_id: str, headers: dict[str, str], *, limit: int = 500
) -> list[dict[str, Any]]:
    """Every result of a run, following the cursor pages of `limit` items."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        r = client.get(f"/v1/replays/{run_id}/results", params=params, headers=headers)
        assert r.status_code == 200, r.text
        page = r.json()
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items


# -- a run on PostgreSQL, Redis and real `replay-audit worker` processes (tests/rq_workers.py) --


@pytest.fixture
def pg(postgres_database_url: str) -> Iterator[str]:
    """The test's PostgreSQL database, emptied after the test."""
    yield postgres_database_url
    empty_all_tables(postgres_database_url)


@pytest.fixture
def api(pg: str, rq_redis: RedisNamespace) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The app on `pg` and this test's Redis namespace, with an admin key's headers."""
    settings = Settings(_env_file=None, database_url=pg, **rq_redis.settings())  # type: ignore[call-arg]
    with session_scope(pg) as s:
        key = create_api_key(s, "acme", "admin").key
    with TestClient(create_app(settings)) as client:
        yield client, {"X-API-Key": key}


def run_to_done(
    client: TestClient, h: dict[str, str], runner: HoldingRunner, body: dict[str, Any]
) -> dict[str, Any]:
    """POST /v1/replays with `body`, run its jobs, and the run read back, done."""
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    runner.run_all()
    run: dict[str, Any] = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "done", run
    return run


@pytest.fixture
def decodes_asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every decode the pipeline runs from here on, as (the arm's dtype, its `DecodeRequest`),
    in the order `Arm.decode_batch` is given them."""
    from replay_audit.replays import pipeline

    asked: list[tuple[str, Any]] = []
    decode_batch = pipeline.Arm.decode_batch

    def recording(arm: pipeline.Arm, requests: Any, top_k: int) -> Any:
        asked.extend((arm.resolved.dtype, r) for r in requests)
        return decode_batch(arm, requests, top_k)

    monkeypatch.setattr(pipeline.Arm, "decode_batch", recording)
    return asked
