"""Fixtures of the verification tests on the bundled model: its benign null (small: a few
prompts, three benign variations), and logged traces from it in BF16 and FP16 and from a 4-bit
RTN (group 128) copy of it that claims to be it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.screenings.sweep.plan import ScreenConfig
from replay_audit.screenings.sweep.worker import TorchBackend
from replay_audit.stats.verification import Calibration

PROMPTS = Path(BUNDLED_MODEL_DIR).parent / "prompts.jsonl"
#: Prompts of the null, and (the next ones) of the logged traces.
NULL_PROMPTS, LOGGED_PROMPTS = 8, 10
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

    prompts = TorchBackend(BUNDLED_MODEL_DIR, "cpu").prompts(_rows()[:NULL_PROMPTS])  # type: ignore[arg-type]
    variations = (ScreenConfig("bf16"), ScreenConfig("fp16"))
    return [
        benign_null(
            BUNDLED_MODEL_DIR,
            Target(dtype, None, "sdpa", 1, Intervention()),
            prompts,
            pool=verify_pool,
            device="cpu",
            max_new_tokens=48,
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
