"""The benign null's variations: those that cannot run on this platform are noted in the
calibration, TP 2 among them on a CPU (it needs two CUDA GPUs owned by the pool), so a null
measured here never claims to cover an honest TP-2 provider."""

from __future__ import annotations

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.verifications.null import BENIGN_VARIATIONS, TP_VARIATION, benign_null


@pytest.mark.slow
def test_a_null_measured_on_a_cpu_notes_that_tp_was_not_covered(
    verify_pool: EnginePool,
) -> None:
    rows = [{"id": "a", "prompt": "def main():"}, {"id": "b", "prompt": "Once upon a time"}]
    prompts = TorchFacts(BUNDLED_MODEL_DIR, "cpu").prompts(rows)
    steps: list[tuple[str, int, int]] = []
    cal = benign_null(
        BUNDLED_MODEL_DIR,
        Target("bf16", None, "sdpa", 1, Intervention()),
        prompts,
        pool=verify_pool,
        device="cpu",
        max_new_tokens=6,
        budgets=(4, 8),
        draws=20,
        progress=lambda what, done, total: steps.append((what, done, total)),
    )
    # Its progress (issue 33: the CLI's bar): each variation, the 4-bit alternative, the end.
    assert steps[0][1] == 0 and steps[-1] == ("done", steps[-1][2], steps[-1][2])
    assert [d for _, d, _ in steps] == list(range(len(steps)))
    assert steps[-2][0] == "4-bit alternative"
    (note,) = [n for n in cal.notes if TP_VARIATION.key in n]
    assert "TP 2 not covered" in note and "gloo" in note
    # Every other default variation ran; TP was not among them.
    assert {v.name for v in cal.variations} == {c.key for c in BENIGN_VARIATIONS}
    assert f"x {len(BENIGN_VARIATIONS)} benign variations" in cal.notes[-1]


def test_nulls_measured_with_one_and_with_two_gpus_are_different_calibrations() -> None:
    """The calibration's platform key counts the CUDA GPUs the measuring pool owned: a null
    measured with two holds TP 2 and one measured with one does not, so a worker never reuses
    the other's. A CPU's is 1 (its nulls never hold TP). Calibrations stored before the count
    read back as 1."""
    from dataclasses import replace

    from replay_audit.screenings.sweep.plan import Platform
    from replay_audit.stats.verification import Calibration
    from replay_audit.verifications.null import platform_key

    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", "9.0", devices=1)
    one, two = platform_key(h100, "2.11"), platform_key(replace(h100, devices=2), "2.11")
    assert one["devices"] == 1 and two["devices"] == 2 and one != two
    assert platform_key(Platform("cpu", devices=2), "2.13")["devices"] == 1

    stored = {
        "weights_sha256": "0" * 64,
        "claim": {"dtype": "bf16", "lm_head_dtype": "bf16", "attn_kernel": "sdpa"},
        "platform": {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "sm": "9.0"},
        "false_alarm_rate": 0.01,
        "scorer": {"null_bins": [1.0], "alt_bins": [1.0], "tie_band_ulps": 4.0},
        "variations": [],
        "alternative": None,
        "statistic": "outside_tie_band",
        "budgets": {},
        "version": 1,
        "notes": [],
    }
    assert Calibration.from_json(stored).platform["devices"] == 1
