"""Fixtures of the verification tests on the bundled model: its benign null (small: a few
prompts, three benign variations), and logged traces from it in BF16 and FP16 and from a 4-bit
RTN (group 128) copy of it that claims to be it; for the tests over HTTP, the app's jobs held
until run (`job_runner`), the worker context of the bundled checkpoint (`measured`), the
session's null taken in place of measuring one (`null_claims`), traces stored (`store`) and
verified (`verify`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.screenings.sweep.plan import ScreenConfig
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.stats.verification import Calibration
from replay_audit.verifications import tasks
from replay_audit.worker import context
from tests.replays.conftest import HoldingRunner

PROMPTS = Path(BUNDLED_MODEL_DIR).parent / "prompts.jsonl"
#: Prompts of the null, and (the next ones) of the logged traces.
NULL_PROMPTS, LOGGED_PROMPTS = 8, 12
NULL_MAX_NEW_TOKENS = 48
BUDGETS = (16, 32, 64, 128, 256, 512)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def verify_pool() -> EnginePool:
    return EnginePool(device="cpu")


@pytest.fixture(scope="session")
def rtn4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import rtn_checkpoint

    return rtn_checkpoint(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("rtn4"), bits=4)


@pytest.fixture(scope="session")
def calibrations(verify_pool: EnginePool) -> list[Calibration]:
    """The bundled model's null on this CPU for the BF16 and the FP16 claim."""
    from replay_audit.verifications.null import benign_null

    prompts = TorchFacts(BUNDLED_MODEL_DIR, "cpu").prompts(_rows()[:NULL_PROMPTS])  # type: ignore[arg-type]
    variations = (ScreenConfig("bf16"), ScreenConfig("fp16"))
    return [
        benign_null(
            BUNDLED_MODEL_DIR,
            Target(dtype, None, "sdpa", 1, Intervention()),
            prompts,
            pool=verify_pool,
            device="cpu",
            max_new_tokens=NULL_MAX_NEW_TOKENS,
            variations=variations,
            budgets=BUDGETS,
            draws=300,
        )
        for dtype in ("bf16", "fp16")
    ]


def _generate(model_dir: Path, dtype: str, claim_sha: str | None = None) -> list[dict[str, Any]]:
    from replay_audit.engine.generate import TraceGenerator

    gen = TraceGenerator(model_dir, dtype=dtype, attn_kernel="sdpa", device="cpu", threads=1)
    rows = _rows()[NULL_PROMPTS : NULL_PROMPTS + LOGGED_PROMPTS]
    traces = [gen.trace(r["prompt"], max_new_tokens=48, external_id=str(r["id"])) for r in rows]
    for t in traces:
        t["model"]["name"] = "tiny-llama"
        if claim_sha is not None:  # the provider claims the reference checkpoint
            t["model"]["weights_sha256"] = claim_sha
    return traces


@pytest.fixture(scope="session")
def logged(verify_pool: EnginePool, rtn4_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Trace JSON per provider: honest BF16 and FP16, and the 4-bit RTN copy logged in BF16."""
    sha = verify_pool.weights_sha256(BUNDLED_MODEL_DIR)
    return {
        "bf16": _generate(BUNDLED_MODEL_DIR, "bf16"),
        "fp16": _generate(BUNDLED_MODEL_DIR, "fp16"),
        "rtn4": _generate(rtn4_dir, "bf16", claim_sha=sha),
    }


@pytest.fixture
def job_runner(client: TestClient) -> HoldingRunner:
    """The app's jobs wait here until `run_all()`."""
    r = HoldingRunner()
    state = client.app.state  # type: ignore[attr-defined]
    state.queue = dataclasses.replace(state.queue, runner=r)
    return r


@pytest.fixture
def measured(
    monkeypatch: pytest.MonkeyPatch, db_url: str, verify_pool: EnginePool
) -> Iterator[list[dict[str, Any]]]:
    """Jobs run on the bundled checkpoint with the real engine; a null they measure is the
    session's (the list holds each claim measured)."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(BUNDLED_MODEL_DIR))
    # The shape of the session's null (`calibrations`): a stored null of another is measured
    # again.
    monkeypatch.setenv("REPLAY_AUDIT_VERIFY_NULL_PROMPTS", str(NULL_PROMPTS))
    monkeypatch.setenv("REPLAY_AUDIT_VERIFY_NULL_MAX_NEW_TOKENS", str(NULL_MAX_NEW_TOKENS))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    context.install_worker_context(context.WorkerContext(settings, verify_pool))
    claims: list[dict[str, Any]] = []
    yield claims
    context.install_worker_context(None)
    tasks.install_null_measure(None)


@pytest.fixture
def null_claims(
    measured: list[dict[str, Any]], calibrations: list[Calibration]
) -> list[dict[str, Any]]:
    """`measured`, where jobs that need a null take the session's (`calibrations`) instead of
    measuring one: the claims they asked for."""

    def measure(model_dir: Path, claim: dict[str, Any], rate: float, *_: Any) -> Calibration:
        assert model_dir == BUNDLED_MODEL_DIR and rate == 0.01
        measured.append(claim)
        return next(c for c in calibrations if c.claim == claim)

    tasks.install_null_measure(measure)
    return measured


def verify(client: TestClient, admin: dict[str, str], runner: HoldingRunner, **body: Any) -> Any:
    """`POST /v1/verifications` of `body`, its job run: the verification, done."""
    r = client.post("/v1/verifications", json=body, headers=admin)
    assert r.status_code == 201, r.text
    assert runner.run_all() == 1
    got = client.get(f"/v1/verifications/{r.json()['id']}", headers=admin).json()
    assert got["status"] == "done", got["error"]
    return got


def store(
    client: TestClient,
    admin: dict[str, str],
    traces: list[dict[str, Any]],
    tag: str,
    *more_tags: str,
    prefix: str | None = None,
) -> list[str]:
    """Store `traces` tagged `tag` (and `more_tags`), their external ids led by `prefix` (by
    default the tag); their public ids."""
    ids = []
    for t in traces:
        body = t | {"tags": [tag, *more_tags], "external_id": f"{prefix or tag}-{t['external_id']}"}
        r = client.post("/v1/traces", json=body, headers=admin)
        assert r.status_code in (200, 201), r.text
        ids.append(str(r.json()["id"]))
    return ids
