"""The benign null's variations: those that cannot run on this platform are noted in the
calibration, TP 2 among them on a CPU (it needs two CUDA GPUs owned by the pool), so a null
measured here never claims to cover an honest TP-2 provider."""

from __future__ import annotations

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.screenings.sweep.worker import TorchBackend
from replay_audit.verifications.null import BENIGN_VARIATIONS, TP_VARIATION, benign_null


@pytest.mark.slow
def test_a_null_measured_on_a_cpu_notes_that_tp_was_not_covered(
    verify_pool: EnginePool,
) -> None:
    rows = [{"id": "a", "prompt": "def main():"}, {"id": "b", "prompt": "Once upon a time"}]
    prompts = TorchBackend(BUNDLED_MODEL_DIR, "cpu").prompts(rows)
    cal = benign_null(
        BUNDLED_MODEL_DIR,
        Target("bf16", None, "sdpa", 1, Intervention()),
        prompts,
        pool=verify_pool,
        device="cpu",
        max_new_tokens=6,
        budgets=(4, 8),
        draws=20,
    )
    (note,) = [n for n in cal.notes if TP_VARIATION.key in n]
    assert "TP 2 not covered" in note and "gloo" in note
    # Every other default variation ran; TP was not among them.
    assert {v.name for v in cal.variations} == {c.key for c in BENIGN_VARIATIONS}
    assert f"x {len(BENIGN_VARIATIONS)} benign variations" in cal.notes[-1]
